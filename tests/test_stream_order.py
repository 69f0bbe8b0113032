"""`StreamOrder`'s worker split: whole batches per worker, and a resumed pass that goes on
batch for batch as the uninterrupted one did (same worker count) or reads each remaining
sample once (another count); then the same through `make_loader` on a real wds dataset."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.utils.data
from conftest import batch_list, per_sample, write_dataset

import dlpipe
from dlpipe.loading import stream_order as order_module
from dlpipe.loading.state import StateMismatchError
from dlpipe.loading.stream_order import StreamOrder


def worker_batches(order: StreamOrder, workers: int, monkeypatch) -> list[list[list[int]]]:
    """Each worker's batches (stream positions) of the pass `take` starts, as a worker cuts
    them: consecutive positions of its runs, a full batch at a time, then what is left."""
    out = []
    epoch = None
    for worker in range(workers):
        copy = StreamOrder.__new__(StreamOrder)
        copy.__dict__ = {**order.__dict__}  # each worker has its own copy of the order
        monkeypatch.setattr(order_module, "worker_part", lambda w=worker: (w, workers))
        epoch = copy.take(workers)
        positions = [p for start, stop in copy.worker_runs() for p in range(start, stop)]
        size = order.batch_size
        out.append([positions[i : i + size] for i in range(0, len(positions), size)])
    order.take(workers)
    assert epoch == order.epoch
    return out


def round_robin(per_worker: list[list[list[int]]]) -> list[list[int]]:
    """The DataLoader's in-order sequence: one batch from each worker in turn, a worker with
    none left skipped from then on."""
    queues = [list(batches) for batches in per_worker]
    out = []
    while any(queues):
        for queue in queues:
            if queue:
                out.append(queue.pop(0))
    return out


def give(order: StreamOrder, batches: list[list[int]]) -> dict:
    """The state after the caller got `batches` more of the pass (what the loader saves)."""
    runs = order.consumed + [(p, p + 1) for batch in batches for p in batch]
    return order.state_at(order.epoch, order.base, order.workers, runs)


CASES = [  # shard sizes, batch size, training (equal whole batches) or evaluation
    ([8, 8, 8, 8], 4, True),
    ([5, 7, 3, 11, 9, 6], 4, True),
    ([5, 7, 3, 11, 9, 6], 4, False),
    ([13], 3, False),
    ([40, 1, 2], 8, False),
]


@pytest.mark.parametrize(("sizes", "batch", "training"), CASES)
@pytest.mark.parametrize("workers", [1, 2, 3, 5])
def test_each_worker_reads_whole_batches_and_the_pass_reads_every_sample_once(
    sizes, batch, training, workers, monkeypatch
) -> None:
    order = StreamOrder(sizes, seed=2, batch_size=batch, equal_shares=training)
    per_worker = worker_batches(order, workers, monkeypatch)
    sequence = round_robin(per_worker)
    lo, hi = order.rank_range()
    assert sorted(p for b in sequence for p in b) == list(range(lo, hi))
    assert all(len(b) == batch for b in sequence[:-1])  # only the pass's last may be short
    assert len(sequence) == -(-(hi - lo) // batch)
    counts = [len(batches) for batches in per_worker]
    assert max(counts) - min(counts) <= 1 or not training  # (the partial batch adds one)


def resumed_after(make, workers: int, given: list[list[int]], monkeypatch) -> StreamOrder:
    """A new order (`make()`) loaded with the state that a pass read by `workers` workers
    saved after the caller got the batches `given`."""
    reference = make()
    worker_batches(reference, workers, monkeypatch)
    resumed = make()
    resumed.load_state_dict(give(reference, given))
    return resumed


@pytest.mark.parametrize(("sizes", "batch", "training"), CASES)
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_a_resume_with_the_same_workers_goes_on_batch_for_batch(
    sizes, batch, training, workers, monkeypatch
) -> None:
    make = functools.partial(StreamOrder, sizes, seed=2, batch_size=batch, equal_shares=training)
    whole = round_robin(worker_batches(make(), workers, monkeypatch))
    for given in range(len(whole)):
        resumed = resumed_after(make, workers, whole[:given], monkeypatch)
        assert round_robin(worker_batches(resumed, workers, monkeypatch)) == whole[given:]
        if given + 1 < len(whole):  # a state saved in the resumed pass resumes it too
            again = make()
            again.load_state_dict(give(resumed, whole[given : given + 1]))
            assert round_robin(worker_batches(again, workers, monkeypatch)) == whole[given + 1 :]


@pytest.mark.parametrize(("sizes", "batch", "training"), CASES)
@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 1), (1, 2), (5, 2)])
def test_a_resume_with_other_workers_reads_each_remaining_sample_once_in_whole_batches(
    sizes, batch, training, before, after, monkeypatch
) -> None:
    make = functools.partial(StreamOrder, sizes, seed=2, batch_size=batch, equal_shares=training)
    whole = round_robin(worker_batches(make(), before, monkeypatch))
    for given in range(len(whole)):
        resumed = resumed_after(make, before, whole[:given], monkeypatch)
        rest = round_robin(worker_batches(resumed, after, monkeypatch))
        left = sorted(p for b in whole[given:] for p in b)
        assert sorted(p for b in rest for p in b) == left
        assert all(len(b) == batch for b in rest[:-1])
        assert len(rest) == -(-len(left) // batch)
        if len(rest) > 1:  # a state saved in that pass resumes it with the new count exactly
            midway = make()
            midway.load_state_dict(give(resumed, rest[:1]))
            assert round_robin(worker_batches(midway, after, monkeypatch)) == rest[1:]


def test_a_crafted_stream_state_is_refused_naming_the_field() -> None:
    order = StreamOrder([8, 8], batch_size=4)
    state = order.state_dict()
    for field, value, message in [
        ("consumed", [[0, 40]], "consumed runs \\[\\(0, 40\\)\\] outside this rank's samples"),
        ("consumed", [[0]], "consumed=\\[\\[0\\]\\], not a list of \\[start, stop\\] pairs"),
        ("base", "x", "base='x', not a list"),
        ("base", [[8, 16], [0, 8]], "base runs \\(\\(8, 16\\), \\(0, 8\\)\\) out of order"),
        ("base", [[0, 8], [4, 12]], "overlapping"),
        ("workers", -1, "workers=-1, not a worker count"),
        ("workers", "2", "workers='2', not a worker count"),
    ]:
        with pytest.raises(StateMismatchError, match=message):
            StreamOrder([8, 8], batch_size=4).load_state_dict(state | {field: value})


# through make_loader: a wds dataset whose shards (5) do not hold whole batches (4)


@pytest.fixture
def stream(tmp_path, samples) -> str:
    return write_dataset(tmp_path / "wds", "wds", {"train": samples[:40]}, max_shard_samples=5)


def worker_of(sample: dict) -> dict:
    """A transform that says which DataLoader worker made each sample (a batch of dicts is
    a list of them)."""
    info = torch.utils.data.get_worker_info()
    return {"key": str(sample["__key__"]), "worker": -1 if info is None else info.id}


def keys(batch: list[dict]) -> list[str]:
    return [sample["key"] for sample in batch]


def loader(path: str, workers: int) -> dlpipe.PreparedLoader:
    config = dlpipe.LoaderConfig(batch_size=4, transform=worker_of, seed=3)
    return dlpipe.make_loader(path, "train", config, workers=workers)


@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3 workers on 2 cores
@pytest.mark.parametrize("workers", [2, 3])
def test_every_batch_is_one_workers_in_turn(stream, workers) -> None:
    batches = list(loader(stream, workers))
    assert [{s["worker"] for s in batch} for batch in batches] == [
        {k % workers} for k in range(len(batches))
    ]
    every = [key for batch in batches for key in keys(batch)]
    assert len(every) == len(set(every)) == 40


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers", [2, 3])
def test_a_loader_resumed_with_the_same_workers_yields_the_uninterrupted_batches(
    stream, workers
) -> None:
    whole = [keys(batch) for batch in loader(stream, workers)]
    for stop in (1, 2, 5):
        first = loader(stream, workers)
        iterator = iter(first)
        for _ in range(stop):
            next(iterator)
        state = first.state_dict()
        first.close()
        resumed = loader(stream, workers)
        resumed.load_state_dict(state)
        assert [keys(batch) for batch in resumed] == whole[stop:]
        following = [keys(batch) for batch in resumed]  # the next epoch
        assert sorted(itertools.chain(*following)) == sorted(itertools.chain(*whole))


def test_a_state_saved_by_dlpipe_0_1_0_resumes(stream) -> None:
    """0.1.0 saved a cursor per shard: the first n samples of this rank's part of it."""
    whole = [key for batch in loader(stream, 0) for key in keys(batch)]
    order = loader(stream, 0).order
    assert isinstance(order, StreamOrder)
    first, second = order.segments(0)[:2]
    old = {k: v for k, v in loader(stream, 0).state_dict().items() if k != "consumed"}
    del old["base"], old["workers"]
    old["cursors"] = [[first.shard, 5], [second.shard, 3]]
    resumed = loader(stream, 2)
    resumed.load_state_dict(old)
    rest = [key for batch in resumed for key in keys(batch)]
    assert sorted(rest) == sorted(whole[5 + 3 :]) and len(rest) == 32


@pytest.mark.parametrize("workers", [1, 2])
def test_worker_batches_give_every_sample_as_zero_workers_do(workers, tmp_path, samples) -> None:
    """Shards of 5 samples, batches of 16, an evaluation-like pass (no drop_last): whole
    batches from each worker, the short one last; each sample once, with the 0-worker
    loader's pixels."""
    path = write_dataset(tmp_path / "data", "wds", {"train": samples}, max_shard_samples=5)
    config = dlpipe.LoaderConfig(batch_size=16, image_size=16, drop_last=False, seed=2)
    inline = batch_list(dlpipe.make_loader(path, "train", config, workers=0, profile=None))
    loaded = batch_list(dlpipe.make_loader(path, "train", config, workers=workers, profile=None))
    assert [len(b[0]) for b in loaded] == [16, 16, 8]
    assert per_sample(loaded) == per_sample(inline)


def test_a_segment_inside_a_block_reads_only_its_own_samples(stream, monkeypatch) -> None:
    """Workers' stretches begin and end inside the shuffle's blocks: each reads only its own
    samples' member data, and gets the samples the whole block's read gives."""
    from dlpipe.formats import wds
    from dlpipe.loading.stream_order import Segment

    ds = dlpipe.open_dataset(stream)
    order = StreamOrder([len(r) for r in ds.readers], seed=4, batch_size=4)
    whole = [s["__key__"] for _, s in order.read(ds.readers, order.segments(0), 0)]
    read: list[str] = []
    real = wds._read_at
    monkeypatch.setattr(
        wds, "_read_at", lambda f, member: read.append(member.name) or real(f, member)
    )
    shard = order.segments(0)[1]
    part = Segment(shard.shard, 1, 4, shard.position + 1)  # 3 of a 5-sample block
    keys = [s["__key__"] for _, s in order.read(ds.readers, [part], 0)]
    assert keys == whole[shard.position + 1 : shard.position + 4]
    assert sorted({name.split(".")[0] for name in read}) == sorted(keys)
