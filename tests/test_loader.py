"""make_loader: uint8 batches from every format, exact ranks, mid-epoch resume."""

from __future__ import annotations

import pytest
import torch
from conftest import FORMAT_NAMES, batch_list, rank_keys, resumed_rest

import dlpipe
from dlpipe.loading.order import EpochSampler

RANDOM_ACCESS = [f for f in FORMAT_NAMES if dlpipe.FORMATS[f].random_access]


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_batches_are_uint8_nchw_with_labels(fmt, make_dataset, samples) -> None:
    loader = dlpipe.make_loader(
        make_dataset(fmt), "val", dlpipe.LoaderConfig(batch_size=4, image_size=32), workers=0
    )
    (images, labels), (_, labels2) = batch_list(loader)
    assert images.shape == (4, 3, 32, 32) and images.dtype == torch.uint8
    assert labels.tolist() + labels2.tolist() == [int(s["cls"]) for s in samples[32:40]]
    normalized = dlpipe.normalize(images)
    assert normalized.dtype == torch.float32 and abs(float(normalized.mean())) < 3


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_mid_epoch_resume_yields_exactly_the_remaining_batches(fmt, make_dataset) -> None:
    path = make_dataset(fmt)

    def loader():
        return dlpipe.make_loader(
            path, "train", dlpipe.LoaderConfig(batch_size=4, image_size=24, seed=5), workers=2
        )

    rest, again = resumed_rest(loader, 3)
    assert 3 + len(rest) == 8 and len(again) == len(rest)
    for (a, la), (b, lb) in zip(rest, again, strict=True):
        assert torch.equal(la, lb) and torch.equal(a, b)  # same samples, same augmentation


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_each_pass_is_a_new_epoch_with_a_new_order(fmt, make_dataset) -> None:
    loader = dlpipe.make_loader(
        make_dataset(fmt), "train", dlpipe.LoaderConfig(batch_size=8, transform=None), workers=0
    )
    epochs = [[s["__key__"] for batch in loader for s in batch] for _ in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) and epochs[0] != epochs[1]


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_ranks_get_equal_disjoint_batches(fmt, tmp_path, samples) -> None:
    from conftest import write_dataset

    path = write_dataset(tmp_path / "d", fmt, {"train": samples[:37]}, max_shard_samples=5)
    parts = [rank_keys(path, rank, workers=0) for rank in range(2)]
    assert len(parts[0]) == len(parts[1]) == 16  # 18 per rank, 4 full batches each
    assert not set(parts[0]) & set(parts[1])


def test_eval_sampler_reads_every_sample_once_without_padding() -> None:
    seen = [
        list(EpochSampler(10, rank=r, world_size=3, shuffle=False, drop_last=False))
        for r in range(3)
    ]
    indices = sorted(i for part in seen for _, i in part)
    assert indices == list(range(10))


def test_sampler_state_round_trip_and_seed_check() -> None:
    sampler = EpochSampler(20, seed=1)
    it = iter(sampler)
    head = [next(it) for _ in range(7)]
    state = sampler.state_dict()
    tail = list(it)
    other = EpochSampler(20, seed=1)
    other.load_state_dict(state)
    assert list(other) == tail and len(head) + len(tail) == 20
    with pytest.raises(ValueError, match="seed"):
        EpochSampler(20, seed=2).load_state_dict(state)


def test_wds_with_fewer_shards_than_workers_reads_every_sample_once(tmp_path, samples) -> None:
    from conftest import write_dataset

    path = write_dataset(tmp_path / "d", "wds", {"train": samples[:8]}, max_shard_samples=None)
    loader = dlpipe.make_loader(
        path, "train", dlpipe.LoaderConfig(batch_size=2, transform=None), workers=2
    )
    keys = [s["__key__"] for batch in loader for s in batch]
    assert sorted(keys) == sorted(s["__key__"] for s in samples[:8]) and len(loader) == 4


def test_wds_split_smaller_than_a_batch_per_rank_says_so(tmp_path, samples) -> None:
    from conftest import write_dataset

    path = write_dataset(tmp_path / "d", "wds", {"train": samples[:8]}, max_shard_samples=None)
    with pytest.raises(dlpipe.ShardCountError, match="fewer than one batch of 8 for each of 2"):
        dlpipe.make_loader(
            path,
            "train",
            dlpipe.LoaderConfig(batch_size=8, transform=None),
            workers=0,
            rank=0,
            world_size=2,
        )


def test_wds_resume_seeks_past_finished_blocks(make_dataset) -> None:
    from dlpipe.loading.stream_order import StreamOrder

    ds = dlpipe.open_dataset(make_dataset("wds"))
    order = StreamOrder([len(r) for r in ds.readers], shuffle=True, seed=3, equal_shares=False)
    order.BLOCK_SAMPLES = 3
    full = [s["__key__"] for _, s in order.read(ds.readers, order.segments(0), 0)]
    second = order.segments(0)[1]
    order.load_state_dict(order.state_at(0, [order.rank_range()], 1, [(0, second.position + 4)]))
    epoch = order.take(1)
    segments = order.segments(epoch, order.worker_runs())
    tail = [s["__key__"] for _, s in order.read(ds.readers, segments, epoch)]
    assert segments[0][:3] == (second.shard, 4, 8) and tail == full[second.position + 4 :]


@pytest.mark.parametrize("context", ["fork", "spawn"])
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_workers_under_fork_and_spawn_give_every_sample_once(fmt, context, make_dataset) -> None:
    loader = dlpipe.make_loader(
        make_dataset(fmt),
        "train",
        dlpipe.LoaderConfig(batch_size=2, transform=None),
        workers={"num_workers": 2, "multiprocessing_context": context},
        profile=None,
    )
    keys = [s["__key__"] for batch in loader for s in batch]
    assert len(keys) == len(set(keys)) == 32


def _worker_pss(loader) -> int:
    from dlpipe.loading.tune_search import _worker_rss

    return _worker_rss()


@pytest.mark.slow
def test_worker_memory_does_not_grow_across_epochs(tmp_path) -> None:
    from conftest import mixed_samples, write_dataset

    path = write_dataset(
        tmp_path / "d", "lmdb", {"train": mixed_samples(400)}, max_shard_samples=50
    )
    loader = dlpipe.make_loader(
        path, "train", dlpipe.LoaderConfig(batch_size=16, transform=None), workers=1, profile=None
    )
    sizes = []
    for _ in range(4):
        assert sum(len(batch) for batch in loader) == 400
        sizes.append(_worker_pss(loader))
    assert sizes[0] > 0
    assert sizes[-1] - sizes[1] < 16 * 2**20, sizes  # no copy-on-read creep per epoch


@pytest.mark.parametrize("drop_last", [True, False])
def test_global_batches_do_not_depend_on_the_world_size(drop_last) -> None:
    """Rank r's k-th batch of b is block r + k*world: step s is the same global batch."""
    n, per_rank = 70, 4
    one = [i for _, i in EpochSampler(n, seed=3, block=8, drop_last=drop_last)]
    ranks = [
        [i for _, i in EpochSampler(n, rank=r, world_size=2, seed=3, block=per_rank,
                                     drop_last=drop_last)]
        for r in range(2)
    ]  # fmt: skip
    steps = n // (2 * per_rank)
    for s in range(steps):
        ddp = {i for r in ranks for i in r[s * per_rank : (s + 1) * per_rank]}
        assert ddp == set(one[s * 8 : (s + 1) * 8])
    if drop_last:
        assert len(ranks[0]) == len(ranks[1]) == n // 2
    else:
        assert sorted(ranks[0] + ranks[1]) == list(range(n))


def test_wds_evaluation_reads_every_sample_once_with_more_readers_than_shards(
    tmp_path, samples
) -> None:
    from conftest import write_dataset

    path = write_dataset(tmp_path / "d", "wds", {"val": samples[:13]}, max_shard_samples=8)
    keys = []
    for rank in range(2):
        loader = dlpipe.make_loader(
            path,
            "val",
            dlpipe.LoaderConfig(batch_size=4, transform=None),
            workers=2,
            rank=rank,
            world_size=2,
        )
        keys += [s["__key__"] for batch in loader for s in batch]
    assert sorted(keys) == sorted(s["__key__"] for s in samples[:13])


@pytest.mark.parametrize("fmt", RANDOM_ACCESS)
def test_an_in_process_loader_and_a_forked_one_share_a_dataset(fmt, make_dataset) -> None:
    """An eval loader without workers keeps shards open while a train loader forks workers
    (a notebook, or a trainer evaluating in-process): the workers reopen them."""
    path = make_dataset(fmt)
    in_process = dlpipe.make_loader(
        path, "val", dlpipe.LoaderConfig(batch_size=4, image_size=24), workers=0
    )
    first = batch_list(in_process, 1)
    forked = dlpipe.make_loader(
        path,
        "val",
        dlpipe.LoaderConfig(batch_size=4, image_size=24),
        workers={"num_workers": 1, "multiprocessing_context": "fork"},
    )
    assert [labels.tolist() for _, labels in batch_list(forked)][:1] == [first[0][1].tolist()]
    assert len(batch_list(in_process)) == len(batch_list(forked))


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_a_loader_reads_parses_and_checks_the_manifest_once(fmt, make_dataset, monkeypatch) -> None:
    import dlpipe.loading.dataset as dataset_module
    import dlpipe.manifest as manifest_module

    path = make_dataset(fmt)
    calls = []

    def counted(name, real):
        def call(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)

        return call

    read = counted("read", manifest_module.read_manifest_bytes)
    parse = counted("parse", manifest_module.parse_manifest)
    for module in (manifest_module, dataset_module):  # also read through read_manifest
        monkeypatch.setattr(module, "read_manifest_bytes", read)
        monkeypatch.setattr(module, "parse_manifest", parse)
    monkeypatch.setattr(dataset_module, "get_format", counted("format", dataset_module.get_format))
    loader = dlpipe.make_loader(path, "train", dlpipe.LoaderConfig(batch_size=4), workers=0)
    next(iter(loader))  # each shard opened checks the manifest is still in place: one stat
    assert calls == ["read", "parse", "format"]
