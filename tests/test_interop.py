"""Shards are readable with no dlpipe code, following the layouts the README documents."""

from __future__ import annotations

import glob
import json
import os
import struct
import tarfile

import h5py
import lmdb
import msgpack
import webdataset as wds


def test_wds_shards_read_by_webdataset(make_dataset, samples) -> None:
    path = make_dataset("wds")
    urls = sorted(glob.glob(os.path.join(path, "train-*.tar")))
    got = list(wds.WebDataset(urls, shardshuffle=False, empty_check=False))
    assert [s["__key__"] for s in got] == [s["__key__"] for s in samples[:32]]
    for mine, theirs in zip(samples[:32], got):
        assert {k: theirs[k] for k in mine if k != "__key__"} == {
            k: v for k, v in mine.items() if k != "__key__"
        }
    decoded = next(iter(wds.WebDataset(urls[:1], shardshuffle=False).decode("pil")))
    assert decoded["cls"] == int(samples[0]["cls"]) and decoded["jpg"].mode == "RGB"


def test_wds_shards_read_by_tarfile(make_dataset, samples) -> None:
    path = make_dataset("wds")
    with tarfile.open(os.path.join(path, "val-000000.tar")) as tar:
        members = tar.getmembers()
        assert all(m.isreg() and m.mtime == 0 and m.uid == 0 for m in members)
        first = samples[32]
        assert [m.name for m in members[:6]] == [
            f"{first['__key__']}.{f}" for f in ("jpg", "png", "cls", "txt", "json", "npy")
        ]
        assert tar.extractfile(members[0]).read() == first["jpg"]


def test_hdf5_shards_read_by_plain_h5py(make_dataset, samples) -> None:
    path = make_dataset("hdf5")
    with h5py.File(os.path.join(path, "train-000001.h5"), "r") as f:
        assert f.attrs["dlpipe_format"] == "hdf5" and f.attrs["samples"] == 8
        assert json.loads(f.attrs["fields"]) == ["jpg", "png", "cls", "txt", "json", "npy"]
        off = f["jpg.offsets"][:]
        keys = f["__key__.offsets"][:]
        i = 3  # sample 8 + 3 of the split
        assert f["jpg"][off[i] : off[i + 1]].tobytes() == samples[11]["jpg"]
        assert f["__key__"][keys[i] : keys[i + 1]].tobytes().decode() == samples[11]["__key__"]
        assert int(f["cls"][i]) == int(samples[11]["cls"])
        assert f["jpg"].attrs["layout"] == "blob" and f["cls"].attrs["layout"] == "int64"
        assert f["jpg"].chunks is None  # contiguous: slice reads touch only the bytes asked for


def test_lmdb_shards_read_by_plain_lmdb(make_dataset, samples) -> None:
    path = make_dataset("lmdb")
    env = lmdb.open(
        os.path.join(path, "train-000002.lmdb"), subdir=False, readonly=True, lock=False
    )
    with env.begin() as txn:
        sample = msgpack.unpackb(txn.get(struct.pack(">Q", 5)), raw=False)
        meta = msgpack.unpackb(txn.get(b"dlpipe.meta"), raw=False)
    env.close()
    assert sample == samples[16 + 5]
    assert meta == {
        "format": "lmdb",
        "format_version": 1,
        "samples": 8,
        "fields": ["jpg", "png", "cls", "txt", "json", "npy"],
    }
    assert not os.path.exists(os.path.join(path, "train-000002.lmdb-lock"))
