"""One contract for every registered format: the same samples in, the same field bytes out."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import FORMAT_NAMES, write_dataset

import dlpipe


def _by_key(items) -> dict[str, dict]:
    return {s["__key__"]: s for s in items}


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_round_trip_keeps_every_field_byte_identical(fmt, make_dataset, samples) -> None:
    path = make_dataset(fmt)
    train = dlpipe.open_dataset(path, "train")
    val = dlpipe.open_dataset(path, "val")
    assert (len(train), len(val)) == (32, 8)
    assert list(train) == samples[:32]  # order, keys and bytes of every field
    assert list(val) == samples[32:]


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_manifest_records_format_fields_classes_and_shards(fmt, make_dataset) -> None:
    path = make_dataset(fmt)
    manifest = dlpipe.read_manifest(path)
    assert manifest.format == fmt
    assert manifest.fields == {
        "jpg": "image",
        "png": "image",
        "cls": "int",
        "txt": "text",
        "json": "json",
        "npy": "ndarray",
    }
    assert manifest.classes[0] == "bars" and len(manifest.classes) == 8
    train = manifest.splits["train"]
    assert [s.samples for s in train.shards] == [8, 8, 8, 8]
    assert train.class_counts == (4,) * 8
    assert train.shards[0].name == dlpipe.FORMATS[fmt].shard_name("train", 0)
    for shard in train.shards:
        assert os.path.getsize(os.path.join(path, shard.name)) == shard.bytes


def test_all_formats_store_the_same_field_bytes(tmp_path: Path, samples) -> None:
    read = {}
    for fmt in FORMAT_NAMES:
        path = write_dataset(tmp_path / fmt, fmt, {"train": samples}, max_shard_samples=13)
        read[fmt] = list(dlpipe.open_dataset(path))
    assert read["wds"] == read["lmdb"] == read["hdf5"] == samples


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_same_input_gives_byte_identical_shards_and_manifest(tmp_path, fmt, samples) -> None:
    a = write_dataset(tmp_path / "a", fmt, {"train": samples})
    b = write_dataset(tmp_path / "b", fmt, {"train": samples})
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    for name in os.listdir(a):
        assert Path(a, name).read_bytes() == Path(b, name).read_bytes(), name


@pytest.mark.parametrize("fmt", [f for f in FORMAT_NAMES if dlpipe.FORMATS[f].random_access])
def test_random_access_by_global_index(fmt, make_dataset, samples) -> None:
    ds = dlpipe.open_dataset(make_dataset(fmt))
    for i in [0, 7, 8, 17, 31]:
        assert ds[i] == samples[i]
    assert ds[-1] == samples[31]
    with pytest.raises(IndexError):
        ds[32]


def test_streaming_format_says_it_has_no_random_access(make_dataset) -> None:
    ds = dlpipe.open_dataset(make_dataset("wds"))
    with pytest.raises(TypeError, match="streaming"):
        ds[0]


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_shards_rotate_by_bytes(tmp_path, fmt, samples) -> None:
    sizes = [sum(len(v) for v in s.values()) for s in samples]
    limit = sum(sizes) // 6
    with dlpipe.DatasetWriter(
        out=str(tmp_path / "d"), format=fmt, limits=dlpipe.ShardLimits(max_shard_bytes=limit)
    ) as writer:
        for sample in samples:
            writer.write("train", sample)
    shards = dlpipe.read_manifest(str(tmp_path / "d")).splits["train"].shards
    assert sum(s.samples for s in shards) == 40 and len(shards) in (6, 7)
    start = 0
    for shard in shards:  # each shard is as full as the budget allows, and no fuller
        end = start + shard.samples
        assert sum(sizes[start:end]) <= limit
        assert end == 40 or sum(sizes[start : end + 1]) > limit
        start = end


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_transform_is_applied_on_read(fmt, make_dataset) -> None:
    ds = dlpipe.open_dataset(make_dataset(fmt), "val", transform=dlpipe.decode_sample)
    labels = [s["cls"] for s in ds]
    assert labels == [int(s) % 8 for s in range(32, 40)]


def test_every_sample_needs_the_same_fields(tmp_path) -> None:
    out = tmp_path / "d"
    with pytest.raises(dlpipe.InvalidFieldError, match="same fields"):
        with dlpipe.DatasetWriter(out=str(out), format="wds") as writer:
            writer.write("train", {"__key__": "a", "txt": b"x"})
            writer.write("train", {"__key__": "b", "txt": b"x", "cls": b"1"})
    assert not (out / "dlpipe.json").exists()  # a failed write never looks finished


def test_labels_must_index_the_classes(tmp_path) -> None:
    with pytest.raises(dlpipe.InvalidFieldError, match="0..1"):
        with dlpipe.DatasetWriter(out=str(tmp_path / "d"), format="hdf5", classes=["a", "b"]) as w:
            w.write("train", {"__key__": "a", "cls": b"5"})
    assert not (tmp_path / "d" / "dlpipe.json").exists()


def test_existing_output_is_refused_unless_overwrite(tmp_path, samples) -> None:
    path = write_dataset(tmp_path / "d", "wds", {"train": samples[:8]})
    with pytest.raises(dlpipe.OutputExistsError, match="--overwrite"):
        write_dataset(path, "wds", {"train": samples[:8]})
    (tmp_path / "d" / "notes.txt").write_text("mine")
    (tmp_path / "d" / "dlpipe-profiles.json").write_text("{}")  # measured on the old data
    with dlpipe.DatasetWriter(out=path, format="lmdb", overwrite=True) as writer:
        writer.write("train", samples[0])
    names = sorted(n for n in os.listdir(path) if n != ".dlpipe-lock")  # the kept writer lock
    assert names == ["dlpipe.json", "notes.txt", "train-000000.lmdb"]  # old shards gone, rest kept


def test_lmdb_on_a_url_is_refused_with_the_fix() -> None:
    with pytest.raises(dlpipe.UnsupportedStorageError, match="local filesystem.*--to wds"):
        dlpipe.DatasetWriter(out="memory://bucket/ds", format="lmdb")


@pytest.mark.parametrize("fmt", ["wds", "hdf5"])
def test_url_formats_write_and_read_through_fsspec(fmt, samples) -> None:
    url = f"memory://dlpipe-tests/{fmt}"
    write_dataset(url, fmt, {"train": samples[:20]})
    assert list(dlpipe.open_dataset(url)) == samples[:20]
    report = dlpipe.verify_dataset(url, decode=True)
    assert report.ok and report.samples_decoded == 20


def test_unknown_split_lists_the_splits(make_dataset) -> None:
    with pytest.raises(KeyError, match="'train', 'val'"):
        dlpipe.open_dataset(make_dataset("wds"), "test")


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_a_shard_cut_short_by_an_error_leaves_nothing_and_the_next_is_whole(
    tmp_path, fmt, samples, monkeypatch
) -> None:
    import dlpipe.formats.lmdb

    monkeypatch.setattr(dlpipe.formats.lmdb, "_COMMIT_EVERY_BYTES", 1)  # a commit per sample
    monkeypatch.setattr(dlpipe.formats.lmdb, "_INITIAL_MAP_BYTES", 64 << 10)  # and map growth

    def failing():
        yield from samples[:10]
        raise RuntimeError("source went away")

    name = dlpipe.FORMATS[fmt].shard_name("train", 0)
    with pytest.raises(RuntimeError, match="source went away"):
        dlpipe.write_shard(dlpipe.FORMATS[fmt], str(tmp_path), name, failing())
    assert os.listdir(tmp_path) == []  # no partial shard, no staging folder
    info = dlpipe.write_shard(dlpipe.FORMATS[fmt], str(tmp_path), name, samples)
    assert info.samples == len(samples) and os.listdir(tmp_path) == [name]
    reader = dlpipe.FORMATS[fmt].reader(str(tmp_path / name), info, list(samples[0])[1:])
    assert list(reader) == samples
