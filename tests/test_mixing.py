"""Mixing several datasets: exact proportions per epoch, determinism, the per-source epoch
rules, exact resume on another worker count and world size, a weight change on resume, and
every bad mixing field or foreign state refused by name."""

from __future__ import annotations

import collections
import io
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import mixed_samples, run_gloo_ranks, write_dataset

import dlpipe
from dlpipe.loading.config import LoaderConfigError
from dlpipe.loading.mixing import share_out
from dlpipe.loading.state import StateMismatchError
from dlpipe.synthetic import SHAPE_CLASSES

GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Two datasets of one class list: A (lmdb, 32 train samples), B (hdf5, 16)."""
    root = tmp_path_factory.mktemp("mix")
    a = write_dataset(root / "a", "lmdb", {"train": mixed_samples(32, seed=1)})
    b = write_dataset(root / "b", "hdf5", {"train": mixed_samples(16, seed=2)})
    return [a, b]


def _loader(paths: Any, *, workers: int = 0, rank: int = 0, world: int = 1, **fields: Any) -> Any:
    fields = {"batch_size": GLOBAL_BATCH // world, "seed": 5, **fields}
    config = dlpipe.LoaderConfig(**fields)
    return dlpipe.make_loader(
        paths, "train", config, workers=workers, profile=None, rank=rank, world_size=world
    )


def _raw(paths: Any, **fields: Any) -> Any:
    return _loader(paths, transform=None, **fields)


def _drawn(batch: list[dict[str, Any]]) -> list[tuple[int, str]]:
    return [(int(s["__source__"]), str(s["__key__"])) for s in batch]


def _epochs(loader: Any, count: int) -> list[list[tuple[int, str]]]:
    return [[d for batch in loader for d in _drawn(batch)] for _ in range(count)]


def test_each_epoch_gives_each_source_its_exact_share(sources) -> None:
    loader = _raw(sources, weights=(0.75, 0.25))
    assert len(loader) == 48 // GLOBAL_BATCH  # default epoch: the sources' total
    for epoch in _epochs(loader, 2):
        counts = collections.Counter(source for source, _ in epoch)
        assert counts == {0: 36, 1: 12}


def test_the_image_batches_say_where_each_sample_came_from(sources) -> None:
    loader = _loader(sources, weights=(0.5, 0.5), image_size=8, epoch_samples=40)
    batches = list(loader)
    assert len(batches) == 5
    images, _, where = batches[0]
    assert images.shape == (GLOBAL_BATCH, 3, 8, 8) and where.dtype == torch.int64
    assert torch.cat([b[2] for b in batches]).bincount().tolist() == [20, 20]


def test_a_cycling_source_goes_on_with_its_next_permutation(sources) -> None:
    """B (16 samples) at half of 48 per epoch: 48 draws over two epochs are three whole
    permutations of it, each of its samples three times, never twice in one of them."""
    drawn = [d for epoch in _epochs(_raw(sources, weights=(1, 1)), 2) for d in epoch]
    b_keys = [key for source, key in drawn if source == 1]
    assert len(b_keys) == 48 and set(collections.Counter(b_keys).values()) == {3}
    assert all(len(set(b_keys[i : i + 16])) == 16 for i in (0, 16, 32))


def test_a_stopping_source_reads_each_sample_once_and_the_others_fill_its_share(
    sources,
) -> None:
    for epoch in _epochs(_raw(sources, weights=(1, 1), on_source_end="stop"), 2):
        assert len(epoch) == 48 and len(set(epoch)) == 48  # every sample of both, once


def test_without_weights_each_sample_is_read_once_an_epoch_in_order(sources) -> None:
    """weights=None shares by size: an evaluation pass (no shuffle, every batch) reads each
    sample of each source once, each source in its stored order, spread evenly."""
    loader = _raw(sources, shuffle=False, drop_last=False, batch_size=5)
    assert len(loader) == 10
    (epoch,) = _epochs(loader, 1)
    assert len(epoch) == 48 and len(set(epoch)) == 48
    assert [source for source, _ in epoch[:6]] == [0, 1, 0, 0, 1, 0]
    stored = [str(s["__key__"]) for s in mixed_samples(16, seed=2)]
    assert [key for source, key in epoch if source == 1] == stored


def test_the_same_seed_gives_the_same_batches_and_another_seed_others(sources) -> None:
    first = _epochs(_raw(sources, weights=(0.6, 0.4)), 2)
    assert _epochs(_raw(sources, weights=(0.6, 0.4)), 2) == first
    assert _epochs(_raw(sources, weights=(0.6, 0.4), seed=6), 2) != first
    assert first[0] != first[1]  # a new interleaving and new permutations each epoch


def _batches(loader: Any, count: int | None = None) -> list[Any]:
    out = []
    for i, (images, labels, where) in enumerate(loader):
        if i == count:
            break
        out.append((images.clone(), labels.clone(), where.clone()))
    return out


def _two_ranks(make: Any, state: dict[str, Any] | None, epochs: int) -> list[Any]:
    """Global batches of a run on 2 ranks in this process (rank 0's block, then rank 1's)."""
    ranks = [make(rank) for rank in (0, 1)]
    out = []
    for loader in ranks:
        if state is not None:
            loader.load_state_dict(state)
    for _ in range(epochs):
        zipped = zip(*[_batches(loader) for loader in ranks], strict=True)
        out += [tuple(torch.cat(parts) for parts in zip(*pair, strict=True)) for pair in zipped]
    return out


def _same(left: list[Any], right: list[Any]) -> bool:
    return len(left) == len(right) and all(
        all(torch.equal(a, b) for a, b in zip(x, y, strict=True))
        for x, y in zip(left, right, strict=True)
    )


def _saved(state: dict[str, Any]) -> dict[str, Any]:
    """`state` through torch.save and torch.load(weights_only=True), as a checkpoint keeps it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_stopped_mixture_resumes_exactly_on_other_workers_and_world_sizes(sources) -> None:
    """Stopped at step 2 with 2 workers on 1 rank; resumed with 1 worker on 2 ranks and with
    0 workers: each is the uninterrupted run, batch for batch, through the next epoch."""
    fields = {"weights": (0.7, 0.3), "image_size": 8}
    whole = _loader(sources, workers=2, **fields)
    uninterrupted = _batches(whole) + _batches(whole)
    stopped = _loader(sources, workers=2, **fields)
    iterator = iter(stopped)
    for _ in range(2):
        next(iterator)
    state = _saved(stopped.state_dict())
    stopped.close()
    whole.close()

    def on_rank(rank: int) -> Any:
        return _loader(sources, workers=1, rank=rank, world=2, **fields)

    assert _same(_two_ranks(on_rank, state, 2), uninterrupted[2:])
    alone = _loader(sources, workers=0, **fields)
    alone.load_state_dict(state)
    assert _same(_batches(alone) + _batches(alone), uninterrupted[2:])
    fresh = _loader(sources, workers=0, **fields)  # the control: the state makes it so
    assert not _same(_batches(fresh) + _batches(fresh), uninterrupted[2:])


_RANK = """
import json, sys, torch, torch.distributed as dist, dlpipe
spec = json.loads(sys.argv[1])
dist.init_process_group("gloo", init_method="env://")
config = dlpipe.LoaderConfig(batch_size=4, image_size=8, seed=5, weights=tuple(spec["weights"]))
loader = dlpipe.make_loader(spec["paths"], "train", config, workers=1, profile=None)
loader.load_state_dict(torch.load(spec["state"], weights_only=True))
batches = [tuple(b) for _ in range(2) for b in loader]
torch.save(batches, spec["out"] + f".{dist.get_rank()}")
loader.close()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_stopped_mixture_resumes_exactly_on_two_gloo_ranks(sources, tmp_path) -> None:
    """Stopped at step 2 with 2 workers on 1 rank, resumed by 2 processes joined by gloo
    (1 worker each): their global batches are the uninterrupted run's."""
    fields = {"weights": (0.7, 0.3), "image_size": 8}
    whole = _loader(sources, workers=2, **fields)
    uninterrupted = _batches(whole) + _batches(whole)
    whole.close()
    stopped = _loader(sources, workers=2, **fields)
    iterator = iter(stopped)
    for _ in range(2):
        next(iterator)
    torch.save(stopped.state_dict(), tmp_path / "state.pt")
    stopped.close()
    spec = {"paths": sources, "weights": [0.7, 0.3], "state": str(tmp_path / "state.pt")}
    spec["out"] = str(tmp_path / "rank")
    parts = run_gloo_ranks(_RANK, json.dumps(spec), 2, spec["out"])
    joined = [
        tuple(torch.cat(pieces) for pieces in zip(*pair, strict=True))
        for pair in zip(*parts, strict=True)
    ]
    assert _same(joined, uninterrupted[2:])


def test_new_weights_on_resume_take_effect_from_that_step(sources) -> None:
    old = _raw(sources, weights=(0.5, 0.5))
    iterator = iter(old)
    head = [d for _ in range(2) for d in _drawn(next(iterator))]
    state = _saved(old.state_dict())
    assert state["weights"] == [0.5, 0.5] and sum(state["cursors"]) == 16

    def resumed() -> list[list[tuple[int, str]]]:
        new = _raw(sources, weights=(0.9, 0.1))
        new.load_state_dict(state)
        return _epochs(new, 2)

    rest, then = resumed()
    assert resumed() == [rest, then]  # deterministic from the saved step
    expected = share_out(48 - 16, (0.9, 0.1)).tolist()  # the new weights share the rest
    assert [sum(1 for s, _ in rest if s == i) for i in (0, 1)] == expected
    assert collections.Counter(s for s, _ in then) == {0: 43, 1: 5}  # whole epochs: new
    assert head == [d for d in _epochs(_raw(sources, weights=(0.5, 0.5)), 1)[0][:16]]


def test_a_resumed_state_carries_the_weights_in_force(sources) -> None:
    old = _raw(sources, weights=(0.5, 0.5))
    iterator = iter(old)
    next(iterator)
    new = _raw(sources, weights=(0.9, 0.1))
    new.load_state_dict(_saved(old.state_dict()))
    iterator = iter(new)
    next(iterator)
    state = new.state_dict()
    assert state["weights"] == [0.9, 0.1] and state["since"] == GLOBAL_BATCH
    again = _raw(sources, weights=(0.9, 0.1))
    again.load_state_dict(_saved(state))
    rest = [d for batch in iterator for d in _drawn(batch)]
    assert [d for batch in again for d in _drawn(batch)] == rest


@pytest.mark.parametrize(
    ("weights", "rule"),
    [
        ((-1.0, 2.0), "not a finite number >= 0"),
        ((0.0, 0.0), "sums to 0"),
        ((1.0,), "not a list of 2 weights"),
        ((1.0, 2.0, 3.0), "not a list of 2 weights"),
        ((math.nan, 1.0), "not a finite number >= 0"),
        ((math.inf, 1.0), "not a finite number >= 0"),
        ((True, 1.0), "not a finite number >= 0"),
        ("0.7,0.3", "not a list of 2 weights"),
    ],
)
def test_bad_weights_are_refused_by_name(sources, weights, rule) -> None:
    with pytest.raises(LoaderConfigError, match=r"weights=.*" + rule) as refused:
        _raw(sources, weights=weights)
    assert "pass 2 finite numbers >= 0, one per dataset" in str(refused.value)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"on_source_end": "loop"}, r"on_source_end='loop' is not 'cycle' or 'stop'"),
        ({"epoch_samples": 0}, r"epoch_samples=0 is not an integer"),
        ({"epoch_samples": 49, "on_source_end": "stop"}, r"epoch_samples=49 .*at most once"),
        ({"weights": (0, 1), "on_source_end": "stop"}, r"weights=.*zero weight"),
        (
            {"class_map": {"7": {}}},
            r"the class map names dataset '7', which is none of the 2 given",
        ),
        ({"dataset_version": 1}, r"dataset_version=1 names a version of one dataset"),
    ],
)
def test_bad_mixing_fields_are_refused_by_name(sources, fields, message) -> None:
    with pytest.raises(LoaderConfigError, match=message):
        _raw(sources, **fields)


def test_mixing_fields_for_one_dataset_are_refused(sources) -> None:
    with pytest.raises(LoaderConfigError, match="weights=.*pass a list of dataset paths"):
        _raw(sources[0], weights=(1.0,))


def test_a_mixture_decoding_on_the_gpu_is_refused_naming_the_cpu(sources) -> None:
    config = dlpipe.LoaderConfig(batch_size=8, image_size=8)
    with pytest.raises(LoaderConfigError, match=r"decode='cpu' \(always, for a mixture"):
        dlpipe.make_loader(sources, "train", config, workers={"decode": "cuda"}, profile=None)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_wds_source_mixes_as_its_lmdb_twin_does(sources, tmp_path, workers) -> None:
    """A wds source is read by index (its shard readers walk the member headers once): the
    mixture gives the batches a mixture with an lmdb copy of it gives."""
    samples = {"train": mixed_samples(16, seed=2)}
    wds = write_dataset(tmp_path / "w", "wds", samples, max_shard_samples=5)
    twin = write_dataset(tmp_path / "l", "lmdb", samples, max_shard_samples=5)
    assert len(dlpipe.read_manifest(wds).split("train").shards) > 1
    fields = {"weights": (0.5, 0.5), "image_size": 8, "workers": workers}
    got, want = (_batches(_loader([sources[0], p], **fields)) for p in (wds, twin))
    assert _same(got, want) and {int(s) for b in got for s in b[2]} == {0, 1}


def _renamed_dataset(tmp_path: Path, classes: list[str]) -> str:
    with dlpipe.DatasetWriter(out=str(tmp_path / "c"), format="lmdb", classes=classes) as writer:
        for sample in mixed_samples(16, seed=3):
            writer.write("train", sample)
    return str(tmp_path / "c")


def test_a_class_space_mismatch_is_refused_naming_the_classes(sources, tmp_path) -> None:
    other = _renamed_dataset(tmp_path, ["blob", *SHAPE_CLASSES[1:]])
    with pytest.raises(
        LoaderConfigError, match=r"has the class 'blob', which the first"
    ) as refused:
        _raw([sources[0], other])
    message = str(refused.value)
    assert SHAPE_CLASSES[0] in message and 'class_map={"1": {"blob": "CLASS"}}' in message


def _source_labels(paths: list[str], **fields: Any) -> list[int]:
    loader = _loader(paths, image_size=8, shuffle=False, **fields)
    return [
        label
        for _, labels, where in loader
        for label, source in zip(labels.tolist(), where.tolist(), strict=True)
        if source == 1
    ]


def test_sources_with_the_same_class_names_mix_by_name(sources, tmp_path) -> None:
    """C lists A's classes in reverse: C's labels come as A's indices of the same names."""
    other = _renamed_dataset(tmp_path, list(reversed(SHAPE_CLASSES)))
    last = len(SHAPE_CLASSES) - 1
    c_labels = [int(s["cls"]) for s in mixed_samples(16, seed=3)]
    assert _source_labels([sources[0], other]) == [last - label for label in c_labels]


def test_a_class_map_relabels_a_source_by_name(sources, tmp_path) -> None:
    """C calls A's first class "blob": mapped onto it by name, its other classes as they are."""
    other = _renamed_dataset(tmp_path, ["blob", *SHAPE_CLASSES[1:]])
    c_labels = [int(s["cls"]) for s in mixed_samples(16, seed=3)]
    for key in ("1", other):  # a source's index, or its path as given
        class_map = {key: {"blob": SHAPE_CLASSES[0]}}
        assert _source_labels([sources[0], other], class_map=class_map) == c_labels
    merged = {"1": {"blob": SHAPE_CLASSES[1]}}  # several classes onto one
    assert 0 in c_labels and 1 in c_labels  # (the data holds both classes merged)
    assert _source_labels([sources[0], other], class_map=merged) == [max(x, 1) for x in c_labels]


def test_a_state_of_other_sources_is_refused_naming_them(sources, tmp_path) -> None:
    loader = _raw(sources)
    next(iter(loader))
    state = _saved(loader.state_dict())
    other = write_dataset(tmp_path / "o", "lmdb", {"train": mixed_samples(16, seed=9)})
    with pytest.raises(StateMismatchError, match=r"sources=.*this loader reads") as refused:
        _raw([sources[0], other]).load_state_dict(state)
    assert other in str(refused.value) and sources[1] in str(refused.value)
    with pytest.raises(StateMismatchError, match="dataset"):
        _raw(sources[0]).load_state_dict(state)


def test_a_state_whose_draws_do_not_fit_its_position_is_refused(sources) -> None:
    loader = _raw(sources)
    iterator = iter(loader)
    next(iterator)
    state = _saved(loader.state_dict())
    fresh = _raw(sources)
    for cursors in ([0, 0], [state["cursors"][0] - 1, state["cursors"][1] + 1]):
        with pytest.raises(StateMismatchError, match=r"cursors=.*give"):
            fresh.load_state_dict({**state, "cursors": cursors})
    assert fresh.state_dict()["samples"] == 0  # refused: nothing changed


def test_share_out_is_exact_and_respects_caps() -> None:
    assert share_out(10, (0.7, 0.3)).tolist() == [7, 3]
    assert share_out(10, (1, 1, 1)).tolist() == [4, 3, 3]  # ties to the earlier source
    assert share_out(48, (0.5, 0.5), caps=(32, 16)).tolist() == [32, 16]
    assert sum(share_out(1_000_003, (0.1, 0.2, 0.7))) == 1_000_003
