"""Opening a dataset scales with shards, not samples: nothing is made or opened per shard until
that shard is read (counted, not timed)."""

from __future__ import annotations

import pickle
from collections import Counter

import pytest
from conftest import write_dataset

import dlpipe
from dlpipe.formats.base import ShardReader

SHARDS = 200


@pytest.fixture(scope="module")
def many_shards(tmp_path_factory) -> dict[str, str]:
    """One dataset per format with one tiny sample per shard: lmdb 200 shards, the others 40."""
    root = tmp_path_factory.mktemp("shards")
    out = {}
    for fmt, count in (("lmdb", SHARDS), ("hdf5", 40), ("wds", 40)):
        samples = [{"__key__": f"s{i:04d}", "cls": b"1", "txt": b"x"} for i in range(count)]
        out[fmt] = write_dataset(root / fmt, fmt, {"train": samples}, max_shard_samples=1)
    return out


@pytest.fixture
def counted(monkeypatch) -> Counter:
    """Counts ShardReader constructions ("made") and shard file opens ("opened", by path)."""
    counts: Counter = Counter()
    made, check = ShardReader.__init__, ShardReader._check_file

    def counting_init(self, *args, **kwargs) -> None:
        counts["made"] += 1
        made(self, *args, **kwargs)

    def counting_check(self) -> None:
        counts[self.path] += 1
        counts["opened"] += 1
        check(self)

    monkeypatch.setattr(ShardReader, "__init__", counting_init)
    monkeypatch.setattr(ShardReader, "_check_file", counting_check)
    return counts


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5", "wds"])
def test_opening_makes_and_opens_no_shard(many_shards, counted, fmt) -> None:
    ds = dlpipe.open_dataset(many_shards[fmt], "train")
    assert len(ds.readers) == len(ds) and len(ds) in (SHARDS, 40)
    assert counted["made"] == 0 and counted["opened"] == 0
    assert "shards=" in repr(ds)
    ds.close()
    assert counted["made"] == 0


@pytest.mark.parametrize("fmt", ["lmdb", "hdf5"])
def test_reading_sample_i_opens_exactly_its_shard(many_shards, counted, fmt) -> None:
    ds = dlpipe.open_dataset(many_shards[fmt], "train")
    assert ds[17]["__key__"] == "s0017"
    shard = ds.readers[17].path
    assert (counted["made"], counted["opened"], counted[shard]) == (1, 1, 1)
    assert ds[17]["__key__"] == "s0017"  # the same reader, still open
    assert (counted["made"], counted["opened"]) == (1, 1)
    ds.close()


def test_a_stream_opens_only_the_shard_it_reads(many_shards, counted) -> None:
    ds = dlpipe.open_dataset(many_shards["wds"], "train", rank=0, world_size=1)
    first = next(iter(ds))
    assert first["__key__"] == "s0000" and counted["opened"] == 1
    assert counted[ds.readers[0].path] == 1


def test_a_pickled_dataset_carries_no_readers(many_shards, counted) -> None:
    """What a spawned DataLoader worker receives: the manifest, not one reader per shard."""
    ds = dlpipe.open_dataset(many_shards["lmdb"], "train")
    ds[3], ds[150]
    clone = pickle.loads(pickle.dumps(ds))
    assert ds.readers.made() == 2 and clone.readers.made() == 0
    assert clone[150]["__key__"] == "s0150" and clone.readers.made() == 1


def test_the_first_batch_makes_only_the_shards_it_reads(many_shards, counted) -> None:
    config = dlpipe.LoaderConfig(batch_size=4, transform=None, shuffle=False)
    loader = dlpipe.make_loader(many_shards["lmdb"], "train", config, workers=0, profile=None)
    keys = [s["__key__"] for s in next(iter(loader))]
    assert keys == ["s0000", "s0001", "s0002", "s0003"]
    assert counted["made"] == counted["opened"] == 4
