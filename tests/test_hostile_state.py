"""A loader state is untrusted input (it comes from a file): every field a crafted one holds that
is not a position of this loader is refused by name, with its value and the rule, and the loader
is left where it was: no wrong epoch read without a word, no bare numpy or Python error.

Each field is tried with its neighbours: other types, a bool where a count is (``True == 1``), a
float where an int is (it used to be truncated), both signs, sizes past the range (it used to
read the permutation's tail, or an empty epoch), and, for wds, runs that overlap, leave the batch
grid or leave the rank's run."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import FORMAT_NAMES, write_dataset

import dlpipe
from dlpipe.loading.order import EpochSampler
from dlpipe.loading.state import StateMismatchError
from dlpipe.loading.stream_order import StreamOrder

RANDOM_ACCESS = [f for f in FORMAT_NAMES if dlpipe.FORMATS[f].random_access]
BATCH, GIVEN = 4, 2  # 32 train samples in batches of 4; the state is saved after 2 of them


def _loader(path: str) -> dlpipe.PreparedLoader:
    return dlpipe.make_loader(
        path, "train", dlpipe.LoaderConfig(batch_size=BATCH, transform=None, seed=1), workers=0
    )


def _keys(loader: dlpipe.PreparedLoader) -> list[list[str]]:
    return [[s["__key__"] for s in batch] for batch in loader]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, samples) -> dict[str, tuple[str, dict[str, Any], list[list[str]]]]:
    """Per format: the dataset, a state saved after `GIVEN` batches, and the batches after it."""
    out = {}
    for fmt in FORMAT_NAMES:
        path = write_dataset(tmp_path_factory.mktemp(fmt) / fmt, fmt, {"train": samples[:32]})
        loader = _loader(path)
        batches = iter(loader)
        for _ in range(GIVEN):
            next(batches)
        state = loader.state_dict()
        out[fmt] = (path, state, [[s["__key__"] for s in b] for b in batches])
    return out


def _refused_and_untouched(fmt, saved, field: str, value: Any, message: str) -> None:
    """Loading the state with `field` set to `value` raises naming them and `message`; the
    loader, which held the good state, still goes on from it exactly."""
    path, state, rest = saved[fmt]
    loader = _loader(path)
    loader.load_state_dict(state)
    with pytest.raises(StateMismatchError) as refused:
        loader.load_state_dict({**state, field: value})
    text = str(refused.value)
    assert f"{field}" in text and message in text, text
    assert _keys(loader) == rest


# ---- lmdb, hdf5: the sampler's position --------------------------------------------------

MAP_CASES = [
    # samples: consumed this epoch, globally (32 in the split)
    ("samples", -1, "samples=-1: it must be an integer in 0..32"),
    ("samples", -32, "samples=-32: it must be an integer in 0..32"),
    ("samples", 33, "samples=33: it must be an integer in 0..32"),
    ("samples", 10**30, "samples=1000000000000000000000000000000: it must be an integer"),
    ("samples", True, "samples=True: it must be an integer"),
    ("samples", 8.0, "samples=8.0: it must be an integer"),
    ("samples", 9.5, "samples=9.5: it must be an integer"),
    ("samples", "8", "samples='8': it must be an integer"),
    ("samples", None, "samples=None: it must be an integer"),
    # partial: this rank's samples of a batch begun; a loader yields whole batches
    ("partial", -1, "partial=-1: it must be an integer in 0..3"),
    ("partial", 4, "partial=4: it must be an integer in 0..3"),
    ("partial", 1, "partial=1: a loader's position is whole batches of 4"),
    ("partial", 3, "partial=3: a loader's position is whole batches of 4"),
    ("partial", False, "partial=False: it must be an integer"),
    ("partial", 0.0, "partial=0.0: it must be an integer"),
    # epoch
    ("epoch", -1, "epoch=-1: it must be an integer in 0..2147483647"),
    ("epoch", 0.5, "epoch=0.5: it must be an integer"),
    ("epoch", 1.0, "epoch=1.0: it must be an integer"),
    ("epoch", 2**31, "epoch=2147483648: it must be an integer in 0..2147483647"),
    ("epoch", 10**30, "it must be an integer in 0..2147483647"),
    ("epoch", True, "epoch=True: it must be an integer"),
    ("epoch", "0", "epoch='0': it must be an integer"),
    # the loader the state was saved by: its layout and identity
    ("world_size", 0, "world_size=0: it must be an integer in 1.."),
    ("world_size", -2, "world_size=-2: it must be an integer in 1.."),
    ("world_size", True, "world_size=True: it must be an integer in 1.."),
    ("world_size", 1.0, "world_size=1.0: it must be an integer in 1.."),
    ("block", 0, "block=0: it must be an integer in 1.."),
    ("block", 4.0, "block=4.0: it must be an integer in 1.."),
    ("block", True, "block=True: it must be an integer in 1.."),
    ("seed", True, "seed=True, this sampler has seed=1"),
    ("seed", 1.0, "seed=1.0, this sampler has seed=1"),
    ("seed", "1", "seed='1', this sampler has seed=1"),
    ("seed", -1, "seed=-1, this sampler has seed=1"),
    ("shuffle", 1, "shuffle=1, this sampler has shuffle=True"),
    ("shuffle", "True", "shuffle='True', this sampler has shuffle=True"),
    ("shuffle", None, "shuffle=None, this sampler has shuffle=True"),
    ("num_samples", 32.0, "num_samples=32.0, this sampler has num_samples=32"),
    ("num_samples", 64, "num_samples=64, this sampler has num_samples=32"),
    ("dataset", None, "dataset=None, this loader has dataset="),
    ("dataset", 1, "dataset=1, this loader has dataset="),
    ("split", "val", "split='val', this loader has split='train'"),
    ("split", ["train"], "split=['train'], this loader has split='train'"),
]


@pytest.mark.parametrize(("field", "value", "message"), MAP_CASES)
@pytest.mark.parametrize("fmt", RANDOM_ACCESS)
def test_a_crafted_sampler_position_is_refused_and_changes_nothing(
    fmt, field, value, message, saved
) -> None:
    _refused_and_untouched(fmt, saved, field, value, message)


@pytest.mark.parametrize("fmt", RANDOM_ACCESS)
def test_a_mid_batch_position_is_refused_with_another_layout(fmt, saved) -> None:
    _, state, _ = saved[fmt]
    with pytest.raises(StateMismatchError, match="partial=2.*world_size=1 and block=8"):
        EpochSampler(32, seed=1, block=4).load_state_dict({**state, "partial": 2, "block": 8})


def test_a_sampler_alone_resumes_mid_batch_and_a_pass_end_stays_a_pass_end() -> None:
    """The rules are the sampler's: one drawn index by index may stop inside a block; a
    loader's last batch of an epoch that does not divide is short (partial = what was left)."""
    sampler = EpochSampler(10, seed=1, block=4, drop_last=False)
    drawn = iter(sampler)
    head = [next(drawn) for _ in range(5)]
    state = sampler.state_dict()
    assert state["partial"] == 1
    resumed = EpochSampler(10, seed=1, block=4, drop_last=False)
    resumed.load_state_dict(state)
    assert head + list(resumed) == list(EpochSampler(10, seed=1, block=4, drop_last=False))
    with pytest.raises(StateMismatchError, match="partial=1: a loader's position is whole"):
        EpochSampler(10, seed=1, block=4, drop_last=False).load_state_dict(state, batches=True)
    end = {**state, "samples": 8, "partial": 2}  # the last 2 of 10 drawn: the pass's end
    at_end = EpochSampler(10, seed=1, block=4, drop_last=False)
    at_end.load_state_dict(end, batches=True)
    assert list(at_end) == []
    with pytest.raises(StateMismatchError, match="partial=3: this rank has 2 samples left"):
        at_end.load_state_dict({**end, "partial": 3})


@pytest.mark.parametrize("state", ["x", None, [], 3, {"something": "else"}])
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_a_state_that_is_not_a_loader_state_is_refused(fmt, state, saved) -> None:
    path, good, rest = saved[fmt]
    loader = _loader(path)
    loader.load_state_dict(good)
    with pytest.raises(StateMismatchError, match="the saved loader state"):
        loader.load_state_dict(state)
    assert _keys(loader) == rest


# ---- wds: the runs of the stream given to the caller ------------------------------------

STREAM_CASES = [
    # consumed: the runs given; the state holds [[0, 8]] (two batches of 4 of [0, 32))
    ("consumed", [[0, 2]], "whole batches of 4 of base"),
    ("consumed", [[0, 6]], "whole batches of 4 of base"),
    ("consumed", [[2, 10]], "whole batches of 4 of base"),
    ("consumed", [[0, 4], [2, 8]], "consumed runs ((0, 4), (2, 8)) out of order or overlapping"),
    ("consumed", [[0, 8], [0, 8]], "out of order or overlapping"),
    ("consumed", [[4, 8], [0, 4]], "out of order or overlapping"),
    ("consumed", [[8, 4]], "consumed runs [(8, 4)] ending first"),
    ("consumed", [[0, 40]], "consumed runs [(0, 40)] outside this rank's samples [0, 32)"),
    ("consumed", [[-4, 4]], "consumed runs [(-4, 4)] outside this rank's samples [0, 32)"),
    ("consumed", [[0, 8.0]], "consumed=[[0, 8.0]], not a list of [start, stop] pairs"),
    ("consumed", [[0.0, 8]], "not a list of [start, stop] pairs of integers"),
    ("consumed", [[False, 8]], "not a list of [start, stop] pairs of integers"),
    ("consumed", [[0, 4, 8]], "not a list of [start, stop] pairs of integers"),
    ("consumed", [0, 8], "not a list of [start, stop] pairs of integers"),
    ("consumed", "0-8", "not a list of [start, stop] pairs of integers"),
    ("consumed", None, "not a list of [start, stop] pairs of integers"),
    # base: what the pass's readers split (the rank's run, or what a resume left)
    ("base", [[0, 30]], "its 30 samples must be whole batches of 4"),
    ("base", [[0, 16], [8, 32]], "base runs ((0, 16), (8, 32)) out of order or overlapping"),
    ("base", [[16, 32], [0, 16]], "out of order or overlapping"),
    ("base", [[0, 32.0]], "base=[[0, 32.0]], not a list of [start, stop] pairs"),
    ("base", [[0.5, 32]], "not a list of [start, stop] pairs of integers"),
    ("base", [[True, 33]], "not a list of [start, stop] pairs of integers"),
    ("base", [[0, 36]], "base runs [(0, 36)] outside this rank's samples [0, 32)"),
    ("base", [[-4, 28]], "outside this rank's samples"),
    ("base", [[8, 32]], "consumed runs [(0, 8)] outside base"),
    ("workers", -1, "workers=-1, not a worker count"),
    ("workers", True, "workers=True, not a worker count"),
    ("workers", 1.0, "workers=1.0, not a worker count"),
    ("workers", "1", "workers='1', not a worker count"),
    ("workers", 2**40, "not a worker count"),
    ("epoch", -1, "epoch=-1: it must be an integer in 0..2147483647"),
    ("epoch", 1.5, "epoch=1.5: it must be an integer"),
    ("epoch", True, "epoch=True: it must be an integer"),
    ("epoch", 2**40, "it must be an integer in 0..2147483647"),
    ("shard_sizes", [8, 8, 8, 8.0], "shard_sizes=[8, 8, 8, 8.0], this stream order has"),
    ("shard_sizes", [8, 8, 8, True], "this stream order has shard_sizes=[8, 8, 8, 8]"),
    ("shard_sizes", [8, 8, 8], "this stream order has shard_sizes=[8, 8, 8, 8]"),
    ("shard_sizes", "8,8,8,8", "this stream order has shard_sizes=[8, 8, 8, 8]"),
    ("batch_size", 4.0, "batch_size=4.0, this stream order has batch_size=4"),
    ("batch_size", True, "batch_size=True, this stream order has batch_size=4"),
    ("world_size", True, "world_size=True, this stream order has world_size=1"),
    ("seed", True, "seed=True, this stream order has seed=1"),
    ("shuffle", 1, "shuffle=1, this stream order has shuffle=True"),
]


@pytest.mark.parametrize(("field", "value", "message"), STREAM_CASES)
def test_a_crafted_stream_position_is_refused_and_changes_nothing(
    field, value, message, saved
) -> None:
    assert saved["wds"][1]["consumed"] == [[0, 8]] and saved["wds"][1]["base"] == [[0, 32]]
    _refused_and_untouched("wds", saved, field, value, message)


@pytest.mark.parametrize(
    "consumed", [[[0, 4], [4, 8]], ([0, 4], (4, 8)), [[0, 8], [9, 9]], [[0, 8], [30, 30]]]
)
def test_stream_runs_saved_another_way_that_mean_the_same_position_still_resume(
    consumed, saved
) -> None:
    """Touching runs, tuples and empty runs: the same position (states are plain data)."""
    path, state, rest = saved["wds"]
    loader = _loader(path)
    loader.load_state_dict({**state, "consumed": consumed})
    assert _keys(loader) == rest


def test_a_base_left_by_another_worker_count_resumes_on_its_own_grid() -> None:
    """After a resume on another worker count the base is what was left: its batches start
    where it does, so a state given whole batches of that base loads, one off it does not."""
    order = StreamOrder([8, 8], batch_size=4)
    # the base's first batch is positions 2, 3, 10 and 11: it spans its two runs
    state = order.state_dict() | {"base": [[2, 4], [10, 16]], "consumed": [[2, 4], [10, 12]]}
    order.load_state_dict(state)
    assert order.state_dict()["consumed"] == [[2, 4], [10, 12]]
    order.load_state_dict(state | {"consumed": [[12, 16]]})  # the second batch: whole too
    for consumed in ([[10, 14]], [[2, 4]], [[12, 14]]):
        with pytest.raises(StateMismatchError, match="whole batches of 4 of base"):
            StreamOrder([8, 8], batch_size=4).load_state_dict(state | {"consumed": consumed})


@pytest.mark.parametrize(
    "cursors", [[[0, -5]], [[0, 2.5]], [[True, 3]], [[0, True]], [[99, 3]], "x", [[0]], None]
)
def test_a_crafted_state_of_dlpipe_0_1_0_is_refused(cursors, saved) -> None:
    """0.1.0 saved a cursor per shard (the first n samples of this rank's segment of it)."""
    path, state, rest = saved["wds"]
    old = {k: v for k, v in state.items() if k not in ("base", "workers", "consumed")}
    loader = _loader(path)
    loader.load_state_dict(state)
    with pytest.raises(StateMismatchError, match="cursors=.*which are not this rank's shards"):
        loader.load_state_dict({**old, "cursors": cursors})
    assert _keys(loader) == rest
