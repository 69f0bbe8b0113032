"""len(loader) is the exact number of batches this rank yields in an epoch, for every format,
world size and worker count, with and without drop_last, on shards of uneven sizes."""

from __future__ import annotations

import pytest
from conftest import FORMAT_NAMES, write_dataset
from test_elastic_resume import run_ranks

import dlpipe

RANKS = 2


@pytest.fixture
def uneven(tmp_path, samples) -> dict[str, str]:
    """37 train samples in shards of 5 (the last holds 2), one folder per format."""
    return {
        fmt: write_dataset(tmp_path / fmt, fmt, {"train": samples[:37]}, max_shard_samples=5)
        for fmt in FORMAT_NAMES
    }


def _rank_keys(path: str, rank: int, batch_size: int, drop_last: bool) -> tuple[int, list]:
    loader = dlpipe.make_loader(
        path,
        "train",
        dlpipe.LoaderConfig(batch_size=batch_size, transform=None, drop_last=drop_last),
        workers=2,
        rank=rank,
        world_size=RANKS,
        profile=None,
    )
    batches = [[s["__key__"] for s in batch] for batch in loader]
    assert len(batches) == len(loader)  # the count promised is the count yielded
    assert all(len(b) == batch_size for b in batches[:-1])
    loader.close()
    return len(loader), batches


@pytest.mark.parametrize("batch_size", [3, 4])
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_training_ranks_yield_len_equal_whole_batches(uneven, fmt, batch_size) -> None:
    results = [_rank_keys(uneven[fmt], r, batch_size, True) for r in range(RANKS)]
    lengths = [length for length, _ in results]
    assert lengths == [37 // RANKS // batch_size] * RANKS  # 18 per rank, whole batches
    keys = [k for _, batches in results for b in batches for k in b]
    assert all(len(b) == batch_size for _, batches in results for b in batches)
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_evaluation_ranks_yield_len_batches_holding_every_sample_once(uneven, fmt, samples) -> None:
    results = [_rank_keys(uneven[fmt], r, 4, False) for r in range(RANKS)]
    keys = sorted(k for _, batches in results for b in batches for k in b)
    assert keys == sorted(s["__key__"] for s in samples[:37])


def test_wds_length_under_two_gloo_processes(uneven, tmp_path) -> None:
    """Two real ranks (torch.distributed, gloo) with 2 workers each: len(loader) batches."""
    results = run_ranks(
        tmp_path,
        RANKS,
        path=uneven["wds"],
        batch_size=3,
        num_workers=2,
        transform=None,
        epochs=1,
    )
    for result in results:
        assert result["len"] == 37 // RANKS // 3 == len(result["batches"][0])
    keys = [k for r in results for b in r["batches"][0] for k in b]
    assert len(keys) == len(set(keys)) == RANKS * 18
