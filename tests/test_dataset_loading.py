"""open_dataset under DataLoader workers (fork and spawn) and split across ranks."""

from __future__ import annotations

import pytest
import torch.utils.data
from conftest import FORMAT_NAMES, write_dataset

import dlpipe


@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_dataloader_workers_return_every_sample_once_per_epoch(
    fmt, context, make_dataset, samples
) -> None:
    ds = dlpipe.open_dataset(make_dataset(fmt))
    next(iter(ds))  # the parent opened a shard: children must not reuse its handle
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=None,
        num_workers=2,
        multiprocessing_context=context,
        persistent_workers=True,
    )
    expected = sorted(s["__key__"] for s in samples[:32])
    for _epoch in range(2):
        keys = [s["__key__"] for s in loader]
        assert sorted(keys) == expected
    got = {s["__key__"]: s for s in loader}
    assert all(got[s["__key__"]] == s for s in samples[:32])


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_ranks_read_disjoint_parts_that_cover_the_split(fmt, make_dataset, samples) -> None:
    path = make_dataset(fmt)
    parts = [
        [s["__key__"] for s in dlpipe.open_dataset(path, rank=r, world_size=2)] for r in range(2)
    ]
    assert not set(parts[0]) & set(parts[1])
    assert sorted(parts[0] + parts[1]) == sorted(s["__key__"] for s in samples[:32])
    assert len(parts[0]) == len(parts[1]) == 16


def test_map_iteration_splits_inside_a_shard(tmp_path, samples) -> None:
    path = write_dataset(tmp_path / "d", "lmdb", {"train": samples[:10]}, max_shard_samples=None)
    parts = [list(dlpipe.open_dataset(path, rank=r, world_size=3)) for r in range(3)]
    assert [len(p) for p in parts] == [3, 3, 4]
    assert parts[0] + parts[1] + parts[2] == samples[:10]


def test_rank_from_the_environment(monkeypatch, make_dataset) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    ds = dlpipe.open_dataset(make_dataset("wds"))
    assert (ds.rank, ds.world_size) == (1, 4)
    assert len(list(ds)) == 8  # shard 1 of 4
    with pytest.raises(ValueError, match="rank 4"):
        dlpipe.open_dataset(make_dataset("hdf5"), rank=4, world_size=4)


def test_fewer_shards_than_workers_reads_every_sample_once(tmp_path, samples) -> None:
    """A worker without a shard segment yields nothing; no sample is read twice."""
    path = write_dataset(tmp_path / "d", "wds", {"train": samples[:8]}, max_shard_samples=None)
    ds = dlpipe.open_dataset(path)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    assert [s["__key__"] for s in loader] == [s["__key__"] for s in samples[:8]]


def test_stream_ranks_split_inside_a_shard(tmp_path, samples) -> None:
    """wds ranks take equal runs of the shard stream, so 3 ranks share 2 shards."""
    path = write_dataset(tmp_path / "d", "wds", {"train": samples[:10]}, max_shard_samples=5)
    parts = [list(dlpipe.open_dataset(path, rank=r, world_size=3)) for r in range(3)]
    assert [len(p) for p in parts] == [3, 3, 4]
    assert parts[0] + parts[1] + parts[2] == samples[:10]
