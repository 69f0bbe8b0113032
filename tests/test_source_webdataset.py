"""The webdataset source reads existing WebDataset shards in place: img2dataset's output (tars
beside their .parquet and _stats.json) and webdataset.ShardWriter's, and refuses hostile tars."""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import error_records, one_error
from PIL import Image

import dlpipe
from dlpipe.cli import main
from dlpipe.converters.source import SampleError
from dlpipe.converters.sources import open_source
from dlpipe.converters.wds_source import WebDatasetSource
from dlpipe.sample import unescape_key

wds = pytest.importorskip("webdataset")


def _image(seed: int, fmt: str = "JPEG", size: tuple[int, int] = (10, 8)) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt)
    return buffer.getvalue()


def _mask(seed: int, size: tuple[int, int] = (10, 8)) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 3, (size[1], size[0]), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def convert(raw: Path, out: Path, fmt: str = "wds", *extra: str) -> int:
    return main(["convert", str(raw), "--to", fmt, "--out", str(out), "--workers", "1", *extra])


def read_back(out: Path, split: str) -> dict[str, dict[str, Any]]:
    """Member key → the stored sample's fields."""
    dataset = dlpipe.open_dataset(str(out), split, rank=0, world_size=1)
    return {unescape_key(s["__key__"]): dict(s) for s in dataset}


# --- img2dataset -----------------------------------------------------------------------------

FAILED = {
    1: ("failed_to_download", "HTTP Error 404: Not Found"),
    6: ("failed_to_resize", "image decoding error"),
}


def make_img2dataset(root: Path, shards: int = 2, rows: int = 5) -> dict[str, tuple[bytes, ...]]:
    """What ``img2dataset --output_format webdataset`` writes: per shard ``NNNNN.tar`` (jpg, txt,
    json of each success, through webdataset's TarWriter), ``NNNNN.parquet`` (every row's
    metadata, failures included) and ``NNNNN_stats.json``. Returns key → (jpg, txt, json)."""
    root.mkdir(parents=True, exist_ok=True)
    expected = {}
    for shard in range(shards):
        name = f"{shard:05d}"
        metas, successes = [], 0
        with open(root / f"{name}.tar", "wb") as stream:
            writer = wds.TarWriter(stream)
            for row in range(rows):
                key = f"{shard:05d}{row:04d}"  # oom_shard_count 5, oom_sample_per_shard 4
                caption = f"a photo number {shard * rows + row} ünïcode"
                status, error = FAILED.get(shard * rows + row, ("success", None))
                meta = {
                    "url": f"https://example.com/{key}.jpg",
                    "caption": caption,
                    "key": key,
                    "status": status,
                    "error_message": error,
                    "width": 10 if error is None else None,
                    "height": 8 if error is None else None,
                    "original_width": 20 if error is None else None,
                    "original_height": 16 if error is None else None,
                    "exif": None,
                    "sha256": None,
                }
                metas.append(meta)
                if error is not None:
                    continue
                successes += 1
                jpg, js = _image(shard * 100 + row), json.dumps(meta, indent=4)
                writer.write({"__key__": key, "jpg": jpg, "txt": caption, "json": js})
                expected[key] = (jpg, caption.encode(), js.encode())
            writer.close()
        pq.write_table(pa.Table.from_pylist(metas), root / f"{name}.parquet")
        failed = [m["status"] for m in metas if m["status"] != "success"]
        stats = {
            "count": rows,
            "successes": successes,
            "failed_to_download": failed.count("failed_to_download"),
            "failed_to_resize": failed.count("failed_to_resize"),
            "duration": 1.5,
            "start_time": 1700000000.0,
            "end_time": 1700000001.5,
            "status_dict": {
                "success": successes,
                **{m["error_message"]: 1 for m in metas if m["error_message"]},
            },
        }
        (root / f"{name}_stats.json").write_text(json.dumps(stats, indent=4))
    return expected


@pytest.mark.parametrize("fmt", ["wds", "hdf5"])
def test_img2dataset_output_converts_with_captions_and_metadata(tmp_path: Path, fmt: str) -> None:
    raw = tmp_path / "laion"
    expected = make_img2dataset(raw)
    assert open_source(str(raw)).kind == "webdataset"
    out = tmp_path / "out"
    assert convert(raw, out, fmt) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.task == "captioning" and manifest.classes == ()
    assert manifest.fields == {"jpg": "image", "json": "json", "txt": "text"}
    assert manifest.field_schemas["txt"] == {"kind": "caption"}
    source = manifest.source
    assert source["img2dataset"] == {
        "success": 8,
        "failed_to_download": 1,
        "failed_to_resize": 1,
        "not_success_in_tars": 0,
    }
    assert source["unused"] == {"other": 0, "folders": 0, "tar members": 0}
    assert source["layout"].startswith("img2dataset output: 2 tars")
    assert list(manifest.splits) == ["train"]
    stored = read_back(out, "train")
    assert sorted(stored) == sorted(expected)
    for key, (jpg, txt, js) in expected.items():
        assert (stored[key]["jpg"], stored[key]["txt"], stored[key]["json"]) == (jpg, txt, js)


def test_img2dataset_stats_alone_count_when_there_is_no_parquet(tmp_path: Path) -> None:
    raw = tmp_path / "laion"
    make_img2dataset(raw, shards=1)
    (raw / "00000.parquet").unlink()
    out = tmp_path / "out"
    assert convert(raw, out) == 0
    counts = dlpipe.read_manifest(str(out)).source["img2dataset"]
    assert counts["success"] == 4 and counts["failed_to_download"] == 1


def test_img2dataset_sample_whose_status_is_no_success_is_left_out(tmp_path: Path) -> None:
    raw = tmp_path / "laion"
    make_img2dataset(raw, shards=1)
    meta = {"key": "000000099", "status": "failed_to_resize"}
    _rewrite(raw / "00000.tar", extra=[("000000099.jpg", _image(99)), ("000000099.txt", b"x"),
                                       ("000000099.json", json.dumps(meta).encode())])  # fmt: skip
    out = tmp_path / "out"
    assert convert(raw, out) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.source["img2dataset"]["not_success_in_tars"] == 1
    assert "000000099" not in read_back(out, "train") and manifest.splits["train"].samples == 4


def _rewrite(path: Path, extra: list[tuple[str, bytes]] | None = None, drop: int = 0) -> None:
    """Rewrite a tar with tarfile: its members less the last `drop` ones, plus `extra`."""
    with tarfile.open(path) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
    members = members[: len(members) - drop]
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for member, data in members:
            tar.addfile(member, io.BytesIO(data))
        for name, data in extra or []:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_img2dataset_tar_short_of_its_parquet_is_refused(tmp_path: Path, capsys) -> None:
    raw = tmp_path / "laion"
    make_img2dataset(raw)
    _rewrite(raw / "00001.tar", drop=3)  # the last sample's jpg, txt and json
    assert convert(raw, tmp_path / "out") == 2
    line = one_error(capsys)
    assert f"{raw / '00001.tar'} holds 3 samples but its img2dataset metadata lists 4" in line
    assert "remove its .parquet and _stats.json" in line


def test_img2dataset_metadata_without_its_tar_is_refused(tmp_path: Path, capsys) -> None:
    raw = tmp_path / "laion"
    make_img2dataset(raw)
    (raw / "00001.tar").unlink()
    assert convert(raw, tmp_path / "out") == 2
    line = one_error(capsys)
    assert f"{raw / '00001.parquet'} lists 4 downloaded images" in line and "missing" in line


def test_unreadable_parquet_is_one_error_line(tmp_path: Path, capsys) -> None:
    raw = tmp_path / "laion"
    make_img2dataset(raw)
    (raw / "00000.parquet").write_bytes(b"PAR1 not really")
    assert convert(raw, tmp_path / "out") == 2
    assert f"{raw / '00000.parquet'}: cannot be read as Parquet" in one_error(capsys)


# --- webdataset.ShardWriter ------------------------------------------------------------------

CLASSES = ["cat", "dog", "fox"]


def write_shards(pattern: str, samples: list[dict[str, Any]], maxcount: int = 3) -> None:
    with wds.ShardWriter(pattern, maxcount=maxcount, verbose=0) as sink:
        for sample in samples:
            sink.write(sample)


def shard_samples(prefix: str, count: int, seed: int = 0) -> list[dict[str, Any]]:
    """Samples as a ShardWriter user writes them: a png, an int cls, a json dict, a mask."""
    return [
        {
            "__key__": f"{prefix}{i:04d}",
            "png": _image(seed + i, "PNG"),
            "cls": (seed + i) % len(CLASSES),
            "json": {"index": i, "source": prefix},
            "seg.png": _mask(seed + i),
        }
        for i in range(count)
    ]


def check_stored(out: Path, split: str, samples: list[dict[str, Any]], prefix: str = "") -> None:
    stored = read_back(out, split)
    assert sorted(stored) == sorted(prefix + s["__key__"] for s in samples)
    for sample in samples:
        got = stored[prefix + sample["__key__"]]
        assert got["png"] == sample["png"] and got["seg.png"] == sample["seg.png"]
        assert int(got["cls"]) == sample["cls"]
        assert json.loads(got["json"]) == sample["json"]


NAMED_SPLITS = {  # format -> how the tars name their split
    "lmdb": ("train-%06d.tar", "validation-%06d.tar"),
    "hdf5": ("imagenet1k-train-%04d.tar", "imagenet1k-validation-%02d.tar"),  # timm's wds
    "wds": ("cc3m_train.%03d.tar", "cc3m_val.%03d.tar"),
}


@pytest.mark.parametrize("fmt", sorted(NAMED_SPLITS))
def test_shardwriter_shards_split_by_name_with_classes(tmp_path: Path, fmt: str) -> None:
    raw = tmp_path / "shards"
    raw.mkdir()
    train, val = shard_samples("train", 7), shard_samples("val", 4, seed=50)
    write_shards(str(raw / NAMED_SPLITS[fmt][0]), train)
    write_shards(str(raw / NAMED_SPLITS[fmt][1]), val)
    (raw / "classes.txt").write_text("\n".join(CLASSES) + "\n")
    (raw / "README.md").write_text("made with ShardWriter\n")
    assert open_source(str(raw)).kind == "webdataset"
    out = tmp_path / "out"
    assert convert(raw, out, fmt) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.classes == tuple(CLASSES) and manifest.task == "classification"
    assert sorted(manifest.splits) == ["train", "val"]
    assert manifest.fields == {"cls": "int", "json": "json", "png": "image", "seg.png": "image"}
    assert manifest.source["tars"] == 5 and manifest.source["unused"]["other"] == 1
    check_stored(out, "train", train)
    check_stored(out, "val", val)


def test_split_folders_with_nested_keys_and_numbered_classes(tmp_path: Path) -> None:
    raw = tmp_path / "shards"
    samples = {}
    for split, count in (("train", 5), ("test", 2)):
        (raw / split).mkdir(parents=True)
        samples[split] = shard_samples(f"{split}/", count, seed=len(samples) * 10)
        write_shards(str(raw / split / "shard-%06d.tar"), samples[split])
    out = tmp_path / "out"
    assert convert(raw, out, "lmdb") == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.classes == ("0", "1", "2")  # no classes.txt: the labels name them
    assert sorted(manifest.splits) == ["test", "train"]
    check_stored(out, "train", samples["train"])
    check_stored(out, "test", samples["test"])
    dataset = dlpipe.open_dataset(str(out), "test", rank=0, world_size=1)
    assert sorted(s["__key__"] for s in dataset) == ["test%2F0000", "test%2F0001"]


def test_keys_repeating_across_tars_are_prefixed_with_the_tar_name(tmp_path: Path) -> None:
    raw = tmp_path / "shards"
    raw.mkdir()
    first, second = shard_samples("s", 2), shard_samples("s", 2, seed=20)
    write_shards(str(raw / "a-%06d.tar"), first)
    write_shards(str(raw / "b-%06d.tar"), second)
    out = tmp_path / "out"
    assert convert(raw, out) == 0
    stored = read_back(out, "train")
    assert sorted(stored) == [
        "a-000000/s0000",
        "a-000000/s0001",
        "b-000000/s0000",
        "b-000000/s0001",
    ]
    assert stored["b-000000/s0001"]["png"] == second[1]["png"]


def test_sample_missing_a_field_is_skipped_and_an_extra_one_dropped(tmp_path: Path) -> None:
    raw = tmp_path / "shards"
    raw.mkdir()
    samples = shard_samples("k", 6)
    del samples[2]["json"]  # most samples have json: this one is skipped, and listed
    samples[4]["depth.png"] = _image(7, "PNG")  # no other sample has it: dropped, counted
    write_shards(str(raw / "shard-%06d.tar"), samples, maxcount=10)
    out = tmp_path / "out"
    assert convert(raw, out) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.source["dropped_fields"] == {"depth.png": 1}
    assert "depth.png" not in manifest.fields and manifest.splits["train"].samples == 5
    (error,) = error_records(out)
    assert error["key"] == "k0002" and "it has no json member" in error["error"]
    assert "shard-000000.tar, sample 'k0002' at byte" in error["error"]


BAD_LABELS = [
    (b"abc", "'abc' is not a non-negative integer"),
    (b"-1", "'-1' is not a non-negative"),
    (b"7", "label 7 is beyond the 3 classes of classes.txt"),
]


@pytest.mark.parametrize(("cls", "why"), BAD_LABELS)
def test_bad_label_skips_only_its_sample(tmp_path: Path, cls: bytes, why: str) -> None:
    raw = tmp_path / "shards"
    raw.mkdir()
    samples = shard_samples("k", 4)
    samples[1]["cls"] = cls
    write_shards(str(raw / "shard-%06d.tar"), samples, maxcount=10)
    (raw / "classes.txt").write_text("\n".join(CLASSES))
    out = tmp_path / "out"
    assert convert(raw, out) == 0
    (error,) = error_records(out)
    assert error["key"] == "k0001" and why in error["error"]
    assert dlpipe.read_manifest(str(out)).splits["train"].samples == 3


def test_members_webdataset_skips_are_counted_not_read(tmp_path: Path) -> None:
    raw = tmp_path / "shards"
    raw.mkdir()
    tar_path = raw / "shard-000000.tar"
    members = [("./0001.jpg", _image(1)), ("./0001.TXT", b"one"), ("0001.Bad Ext", b"?"),
               ("__meta__", b"{}"), ("noextension", b"x"), ("0002.jpeg", _image(2)),
               ("0002.txt", b"two")]  # fmt: skip
    with tarfile.open(tar_path, "w") as tar:
        tar.addfile(_dir_info("folder"))
        for name, data in members:
            _add(tar, name, data)
    out = tmp_path / "out"
    assert convert(raw, out) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert manifest.source["unused"]["tar members"] == 3
    assert manifest.source["unread_members"] == {
        "extension 'bad ext' is not a field name": 1,
        "not named key.extension": 2,
    }
    stored = read_back(out, "train")
    assert {k: s["txt"] for k, s in stored.items()} == {"0001": b"one", "0002": b"two"}
    assert stored["0002"]["jpg"] == _image(2)


# --- refusals --------------------------------------------------------------------------------


def test_a_dlpipe_dataset_is_no_raw_source(tmp_path: Path, capsys) -> None:
    raw = tmp_path / "shards"
    raw.mkdir()
    write_shards(str(raw / "shard-%06d.tar"), shard_samples("k", 3))
    prepared = tmp_path / "prepared"
    assert convert(raw, prepared) == 0
    capsys.readouterr()
    assert open_source(str(prepared)).kind == "webdataset"
    assert convert(prepared, tmp_path / "again") == 2
    line = one_error(capsys)
    assert f"{prepared} is a dataset dlpipe prepared (dlpipe.json), not raw data" in line
    assert f"dlpipe verify {prepared}" in line


@pytest.mark.parametrize("case", ["compressed", "beside split folders", "unnamed beside named"])
def test_layout_problems_are_one_error_line(tmp_path: Path, case: str, capsys) -> None:
    raw = tmp_path / "shards"
    raw.mkdir()
    write_shards(str(raw / "train-%06d.tar"), shard_samples("k", 2))
    if case == "compressed":
        (raw / "val-000000.tar.gz").write_bytes(b"\x1f\x8b")
        expected = "val-000000.tar.gz is a compressed tar"
    elif case == "beside split folders":
        (raw / "val").mkdir()
        write_shards(str(raw / "val" / "v-%06d.tar"), shard_samples("v", 2))
        expected = "train-000000.tar lies beside the split folders val"
    else:
        write_shards(str(raw / "extra-%06d.tar"), shard_samples("e", 2))
        expected = "extra-000000.tar names no split while other tars do"
    assert convert(raw, tmp_path / "out", "wds", "--source", "webdataset") == 2
    assert expected in one_error(capsys)


def test_tar_without_images_is_refused(tmp_path: Path, capsys) -> None:
    raw = tmp_path / "shards"
    raw.mkdir()
    write_shards(str(raw / "shard-%06d.tar"), [{"__key__": f"k{i}", "txt": "x"} for i in range(3)])
    assert convert(raw, tmp_path / "out") == 2
    assert "3 of 3 samples have no image member" in one_error(capsys)


def test_class_folders_beside_a_tar_stay_class_folders(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    for name in ("cat", "dog"):
        (raw / name).mkdir(parents=True)
        (raw / name / "1.jpg").write_bytes(_image(len(name)))
    write_shards(str(raw / "backup-%06d.tar"), shard_samples("k", 2))
    assert not WebDatasetSource.detect(str(raw))
    assert open_source(str(raw)).kind == "imagefolder"
    (raw / "cat").rename(raw / "train")  # a split folder holding images, not tars, is no class
    (raw / "dog").rename(raw / "val")
    assert WebDatasetSource.detect(str(raw))


# --- hostile tars ----------------------------------------------------------------------------


def _add(tar: tarfile.TarFile, name: str, data: bytes, **fields: Any) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for field, value in fields.items():
        setattr(info, field, value)
    tar.addfile(info, io.BytesIO(data))


def _dir_info(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    return info


def _good_tar(path: Path, prefix: str, count: int) -> dict[str, bytes]:
    images = {f"{prefix}{i}": _image(sum(map(ord, prefix)) + i) for i in range(count)}
    with tarfile.open(path, "w") as tar:
        for key, data in images.items():
            _add(tar, f"{key}.jpg", data)
            _add(tar, f"{key}.txt", key.encode())
    return images


def test_link_and_escaping_members_fail_only_their_samples(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    (tmp_path / "secret.jpg").write_bytes(_image(5))
    with tarfile.open(raw / "evil.tar", "w") as tar:
        _add(tar, "good.jpg", _image(1))
        _add(tar, "good.txt", b"good")
        link = tarfile.TarInfo("link.jpg")
        link.type, link.linkname = tarfile.SYMTYPE, str(tmp_path / "secret.jpg")
        tar.addfile(link)
        _add(tar, "link.txt", b"link")
        _add(tar, "../evil.jpg", _image(2))
        _add(tar, "../evil.txt", b"evil")
        _add(tar, "/abs/olute.jpg", _image(3))
        _add(tar, "/abs/olute.txt", b"abs")
        hard = tarfile.TarInfo("hard.jpg")
        hard.type, hard.linkname = tarfile.LNKTYPE, "good.jpg"
        tar.addfile(hard)
        _add(tar, "hard.txt", b"hard")
    before = sorted(os.listdir(tmp_path))
    out = tmp_path / "out"
    assert convert(raw, out) == 0
    assert sorted(os.listdir(tmp_path)) == sorted([*before, "out"])  # nothing written outside
    assert read_back(out, "train")["good"]["txt"] == b"good"
    found = {e["key"]: e["error"] for e in error_records(out)}
    assert sorted(found) == ["%2E%2E%2Fevil", "%2Fabs%2Folute", "hard", "link"]
    assert f"member 'link.jpg' is a symbolic link (to '{tmp_path / 'secret.jpg'}')" in found["link"]
    assert "member 'hard.jpg' is a hard link" in found["hard"]
    assert "member '../evil.jpg' has an absolute name or one with '..'" in found["%2E%2E%2Fevil"]
    assert "member '/abs/olute.jpg' has an absolute name" in found["%2Fabs%2Folute"]


def _truncated(path: Path) -> tuple[int, str]:
    """Cut a 4-sample tar inside the third sample's image: two whole samples before it."""
    _good_tar(path, "t", 4)
    with tarfile.open(path) as tar:
        third = tar.getmember("t2.jpg")
    with open(path, "r+b") as f:
        f.truncate(third.offset_data + 100)
    return third.offset, f"member 't2.jpg' claims {third.size} bytes at byte {third.offset_data}"


def _cut_at_a_header(path: Path) -> tuple[int, str]:
    """Cut a tar right after its last member: no end-of-archive blocks."""
    _good_tar(path, "t", 3)
    with tarfile.open(path) as tar:
        last = tar.getmember("t2.txt")
    end = last.offset_data + 512
    with open(path, "r+b") as f:
        f.truncate(end)
    return end, f"ends at byte {end} without the end-of-archive blocks"


def _bad_checksum(path: Path) -> tuple[int, str]:
    """A flipped byte in the third sample's first header."""
    _good_tar(path, "t", 4)
    with tarfile.open(path) as tar:
        third = tar.getmember("t2.jpg")
    with open(path, "r+b") as f:
        f.seek(third.offset + 1)
        f.write(b"X")
    return third.offset, f"the header at byte {third.offset} is damaged"


def _huge_member(path: Path) -> tuple[int, str]:
    """A member whose header claims 10 GB in a file of a few KB."""
    _good_tar(path, "t", 2)
    with tarfile.open(path) as tar:
        end = max(m.offset_data + -(-m.size // 512) * 512 for m in tar.getmembers())
    info = tarfile.TarInfo("t9.jpg")
    info.size = 10**10
    with open(path, "r+b") as f:
        f.truncate(end)
        f.seek(end)
        f.write(info.tobuf(tarfile.GNU_FORMAT) + b"\xff" * 4096)
    return end, "member 't9.jpg' claims 10000000000 bytes"


def _huge_pax_header(path: Path) -> tuple[int, str]:
    """A pax extended header claiming 1 GB, which tarfile would read into memory."""
    _good_tar(path, "t", 2)
    with tarfile.open(path) as tar:
        end = max(m.offset_data + -(-m.size // 512) * 512 for m in tar.getmembers())
    info = tarfile.TarInfo("././@PaxHeader")
    info.type, info.size = tarfile.XHDTYPE, 10**9
    with open(path, "r+b") as f:
        f.truncate(end)
        f.seek(end)
        f.write(info.tobuf(tarfile.USTAR_FORMAT) + b"9 path=x\n" * 400)
    return end, f"extended header at byte {end} claims 1000000000 bytes"


def _not_a_tar(path: Path) -> tuple[int, str]:
    path.write_bytes(os.urandom(3000))
    return 0, "not a readable tar from byte 0 on"


DAMAGE = {  # case -> how the tar is damaged, and the samples read whole before it
    "truncated": (_truncated, 2),
    "cut at a header": (_cut_at_a_header, 2),  # t2 might have had more members: not kept
    "bad checksum": (_bad_checksum, 1),  # so might t1
    "huge member": (_huge_member, 2),
    "huge pax header": (_huge_pax_header, 1),  # t1 might have had more members
    "not a tar": (_not_a_tar, 0),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_tar_is_listed_with_its_byte_and_keeps_whole_samples(
    tmp_path: Path, case: str
) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    good = _good_tar(raw / "a.tar", "a", 3)
    damage, kept = DAMAGE[case]
    byte, problem = damage(raw / "b.tar")
    out = tmp_path / "out"
    assert convert(raw, out) == 0
    (error,) = error_records(out)
    assert error["key"] == "b%2Etar" and error["origin"] == str(raw / "b.tar")
    assert error["error"].startswith(f"{raw / 'b.tar'}: damaged at byte {byte}: ")
    assert problem in error["error"] and f"the {kept} samples before it are kept" in error["error"]
    stored = read_back(out, "train")
    assert sorted(stored) == sorted([*good, *(f"t{i}" for i in range(kept))])
    assert all(stored[k]["jpg"] == data for k, data in good.items())
    (listed,) = dlpipe.read_manifest(str(out)).source["damaged_tars"]
    assert listed["byte"] == byte and listed["kept"] == kept


def test_damaged_tar_stops_the_run_with_on_error_fail(tmp_path: Path, capsys) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    _good_tar(raw / "a.tar", "a", 2)
    byte, _ = _truncated(raw / "b.tar")
    assert convert(raw, tmp_path / "out", "wds", "--on-error", "fail") == 2
    captured = capsys.readouterr()
    *warnings, line = captured.err.strip().splitlines()
    assert "Traceback" not in captured.err and [w[:8] for w in warnings] == ["warning:"]
    assert line.startswith(f"error: {raw / 'b.tar'}: damaged at byte {byte}: ")


def test_tar_changed_after_the_scan_fails_its_samples(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    _good_tar(raw / "a.tar", "a", 2)
    source = open_source(str(raw))
    items = source.scan().items
    with open(raw / "a.tar", "ab") as f:
        f.write(b"\0" * 512)
    with pytest.raises(SampleError, match="changed since the scan"):
        source.load(items[0])


def test_one_tar_file_is_a_source_with_its_split_from_its_name(tmp_path: Path) -> None:
    raw = tmp_path / "shards"
    raw.mkdir()
    samples = shard_samples("k", 5)
    write_shards(str(raw / "val-%06d.tar"), samples)  # val-000000.tar and val-000001.tar
    out = tmp_path / "out"
    assert convert(raw / "val-000001.tar", out) == 0
    manifest = dlpipe.read_manifest(str(out))
    assert list(manifest.splits) == ["val"] and manifest.source["tars"] == 1
    check_stored(out, "val", samples[3:])


def test_an_unfinished_conversion_is_no_raw_source(tmp_path: Path, capsys) -> None:
    raw = tmp_path / "shards"
    raw.mkdir()
    write_shards(str(raw / "train-%06d.tar"), shard_samples("k", 2))
    (raw / ".dlpipe-journal").mkdir()
    assert convert(raw, tmp_path / "out") == 2
    line = one_error(capsys)
    assert line.startswith("error: not raw data: ") and "unfinished conversion" in line


def test_the_description_lists_a_bounded_number_of_names(tmp_path: Path) -> None:
    raw = tmp_path / "shards"
    raw.mkdir()
    with tarfile.open(raw / "shard-000000.tar", "w") as tar:
        for i in range(30):
            _add(tar, f"k{i}.jpg", _image(i))
            _add(tar, f"k{i}.bad ext{i}", b"?")
    source = open_source(str(raw))
    unread = source.scan().description["unread_members"]
    assert len(unread) == 21 and unread["others"] == 10 and sum(unread.values()) == 30


def _in_s3(local: Path, url: str, s3_env: dict[str, str], monkeypatch) -> None:
    """`local`'s files uploaded under `url` on the loopback S3 server."""
    import s3fs

    for key, value in s3_env.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    bucket = url.removeprefix("s3://").split("/", 1)[0]
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        fs.put_file(str(path), f"{url.removeprefix('s3://')}/{path.relative_to(local).as_posix()}")


def _shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix == ".tar"}


@pytest.mark.slow
def test_shards_in_object_storage_convert_as_the_local_copy(tmp_path, s3_env, monkeypatch) -> None:
    """img2dataset's output in S3 (tars, parquet and stats beside them) read by byte ranges:
    the same dataset as the local copy, captions, metadata and status counts included."""
    make_img2dataset(tmp_path / "local")
    _in_s3(tmp_path / "local", "s3://dlpipe-raw/laion", s3_env, monkeypatch)
    assert convert(tmp_path / "local", tmp_path / "from-disk") == 0
    args = ["convert", "s3://dlpipe-raw/laion", "--to", "wds", "--workers", "2"]
    assert main([*args, "--out", str(tmp_path / "from-s3")]) == 0
    assert _shard_bytes(tmp_path / "from-s3") == _shard_bytes(tmp_path / "from-disk")
    remote = dlpipe.read_manifest(str(tmp_path / "from-s3")).source
    assert (
        remote["img2dataset"]
        == dlpipe.read_manifest(str(tmp_path / "from-disk")).source["img2dataset"]
    )


@pytest.mark.slow
def test_one_shard_url_and_split_folders_in_object_storage(tmp_path, s3_env, monkeypatch) -> None:
    raw = tmp_path / "local"
    for split, count in (("train", 5), ("val", 3)):
        (raw / split).mkdir(parents=True)
        write_shards(str(raw / split / "shard-%06d.tar"), shard_samples(split, count))
    (raw / "classes.txt").write_text("\n".join(CLASSES))
    _in_s3(raw, "s3://dlpipe-raw/splits", s3_env, monkeypatch)
    assert convert(raw, tmp_path / "from-disk", "lmdb") == 0
    assert main(["convert", "s3://dlpipe-raw/splits", "--to", "lmdb", "--out",
                 str(tmp_path / "from-s3")]) == 0  # fmt: skip
    for split in ("train", "val"):
        assert read_back(tmp_path / "from-s3", split) == read_back(tmp_path / "from-disk", split)
    url = "s3://dlpipe-raw/splits/val/shard-000000.tar"
    assert main(["convert", url, "--to", "wds", "--out", str(tmp_path / "one")]) == 0
    assert dlpipe.read_manifest(str(tmp_path / "one")).splits["train"].samples == 3


@pytest.mark.slow
@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("s3://dlpipe-raw/nothing-here", "holds no WebDataset shards"),
        ("s3://dlpipe-raw-missing-bucket/x", "holds no WebDataset shards"),
    ],
)
def test_a_url_without_shards_is_one_error_line(
    tmp_path, s3_env, monkeypatch, capsys, url: str, message: str
) -> None:
    _in_s3(tmp_path, "s3://dlpipe-raw/other", s3_env, monkeypatch)
    assert main(["convert", url, "--to", "wds", "--out", str(tmp_path / "out")]) == 2
    assert message in one_error(capsys)
    assert not (tmp_path / "out").exists()


def test_only_webdataset_shards_are_read_from_a_url(tmp_path, capsys) -> None:
    command = ["convert", "s3://bucket/coco", "--to", "wds", "--source", "coco"]
    assert main([*command, "--out", str(tmp_path / "out")]) == 2
    assert "only WebDataset shards (.tar) are read from a URL" in one_error(capsys)
