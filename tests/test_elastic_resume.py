"""Elastic exact resume: a loader state saved at step s resumes at step s on another worker
count (every format) and another world size (lmdb, hdf5: two gloo processes), and refuses
what it cannot resume exactly, naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import FORMAT_NAMES, free_port, run_gloo_ranks

import dlpipe
from dlpipe.loading.loader import StaleIteratorError
from dlpipe.loading.state import StateMismatchError

RANDOM_ACCESS = [f for f in FORMAT_NAMES if dlpipe.FORMATS[f].random_access]
GLOBAL_BATCH, STOP = 8, 2  # 32 train samples: 4 steps per epoch, stopped after step 2

_CHILD = """
import json, sys, torch, torch.distributed as dist, dlpipe
spec = json.loads(sys.argv[1])
dist.init_process_group("gloo", init_method="env://")
config = dlpipe.LoaderConfig(batch_size=spec["batch_size"], transform=spec["transform"],
                             image_size=8, seed=5)
loader = dlpipe.make_loader(spec["path"], "train", config, workers=spec["num_workers"],
                            profile=None)
if spec.get("state"):
    loader.load_state_dict(torch.load(spec["state"], weights_only=True))
epochs = [[batch for batch in loader] for _ in range(spec["epochs"])]
if spec["transform"] is None:
    epochs = [[[s["__key__"] for s in b] for b in e] for e in epochs]
out = {"len": len(loader), "batches": epochs}
torch.save(out, spec["out"] + f".{dist.get_rank()}")
loader.close()
dist.destroy_process_group()
"""


def run_ranks(tmp_path: Path, world_size: int, **spec: Any) -> list[dict[str, Any]]:
    """Run one loader per rank in `world_size` processes joined by torch.distributed (gloo on
    127.0.0.1); each returns ``{"len": len(loader), "batches": [epoch, ...]}``."""
    out = str(tmp_path / f"ranks-{free_port()}")
    return run_gloo_ranks(_CHILD, json.dumps({**spec, "out": out}), world_size, out)


def _loader(
    path: str,
    *,
    num_workers: int,
    batch_size: int = GLOBAL_BATCH,
    rank: int | None = None,
    world_size: int | None = None,
    **fields: Any,
) -> Any:
    config = dlpipe.LoaderConfig(**{"batch_size": batch_size, "image_size": 8, "seed": 5, **fields})
    return dlpipe.make_loader(
        path, "train", config, workers=num_workers, profile=None, rank=rank, world_size=world_size
    )


def _epochs(loader: Any, count: int) -> list[list[Any]]:
    return [list(loader) for _ in range(count)]


def _stopped_state(path: str, tmp_path: Path, **kw: Any) -> tuple[list[Any], str]:
    """Stop a 2-worker run after step `STOP`: (the batches it yielded, its saved state file)."""
    loader = _loader(path, num_workers=2, **kw)
    iterator = iter(loader)
    head = [next(iterator) for _ in range(STOP)]
    state_file = str(tmp_path / "state.pt")
    torch.save(loader.state_dict(), state_file)
    loader.close()
    return head, state_file


def _equal(a: list[Any], b: list[Any]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("fmt", RANDOM_ACCESS)
def test_map_resume_with_other_workers_and_world_size_gives_the_same_batches(
    fmt, make_dataset, tmp_path
) -> None:
    path = make_dataset(fmt)
    reference = _epochs(_loader(path, num_workers=0), 2)  # uninterrupted: 1 rank, no workers
    head, state_file = _stopped_state(path, tmp_path)
    assert _equal(head, reference[0][:STOP])

    resumed = _loader(path, num_workers=0)
    resumed.load_state_dict(torch.load(state_file, weights_only=True))
    rest, following = _epochs(resumed, 2)
    assert _equal(rest, reference[0][STOP:]) and _equal(following, reference[1])

    ranks = run_ranks(
        tmp_path,
        2,
        path=path,
        batch_size=GLOBAL_BATCH // 2,
        num_workers=1,
        transform="train",
        state=state_file,
        epochs=2,
    )
    for epoch, expected in enumerate([reference[0][STOP:], reference[1]]):
        steps = zip(*(r["batches"][epoch] for r in ranks), strict=True)
        joined = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in steps]
        assert _equal(joined, expected)  # global step t: rank 0's block, then rank 1's
    assert [r["len"] for r in ranks] == [len(reference[0])] * 2


@pytest.mark.parametrize("fmt", RANDOM_ACCESS)
def test_map_resume_with_another_batch_size_continues_the_same_sample_run(
    fmt, make_dataset, tmp_path
) -> None:
    path = make_dataset(fmt)
    keys = lambda batches: [s["__key__"] for b in batches for s in b]  # noqa: E731
    whole = keys(_loader(path, num_workers=0, transform=None))
    _, state_file = _stopped_state(path, tmp_path, transform=None)
    resumed = _loader(path, num_workers=1, batch_size=4, transform=None)
    resumed.load_state_dict(torch.load(state_file, weights_only=True))
    assert keys(resumed) == whole[STOP * GLOBAL_BATCH :]


@pytest.mark.parametrize("workers", [1, 0])
def test_wds_resume_with_other_workers_reads_each_remaining_sample_once(
    workers, make_dataset, tmp_path
) -> None:
    path = make_dataset("wds")
    head, state_file = _stopped_state(path, tmp_path, transform=None)
    reference = _epochs(_loader(path, num_workers=2, transform=None), 2)
    keys = lambda batches: [s["__key__"] for b in batches for s in b]  # noqa: E731
    resumed = _loader(path, num_workers=workers, transform=None)
    resumed.load_state_dict(torch.load(state_file, weights_only=True))
    rest, following = _epochs(resumed, 2)
    assert len(keys(rest)) == len(set(keys(rest))) == 32 - STOP * GLOBAL_BATCH
    assert sorted(keys(head) + keys(rest)) == sorted(keys(reference[0]))
    assert len(rest) == len(resumed) - STOP
    same_workers = _epochs(_loader(path, num_workers=workers, transform=None), 2)[1]
    assert keys(following) == keys(same_workers)  # the batch order depends on num_workers
    assert sorted(keys(following)) == sorted(keys(reference[1]))


def test_wds_resume_on_another_world_size_is_refused_saying_why(make_dataset, tmp_path) -> None:
    path = make_dataset("wds")
    _, state_file = _stopped_state(path, tmp_path, transform=None)
    other = _loader(path, num_workers=0, batch_size=4, transform=None, rank=0, world_size=2)
    with pytest.raises(StateMismatchError, match="world_size=1.*own run of the epoch's shards"):
        other.load_state_dict(torch.load(state_file, weights_only=True))


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_an_iterator_made_before_load_state_dict_raises_and_the_next_one_resumes(
    fmt, make_dataset
) -> None:
    path = make_dataset(fmt)
    loader = _loader(path, num_workers=0, transform=None)
    first = iter(loader)
    head = [next(first) for _ in range(STOP)]
    state = loader.state_dict()
    rest = list(first)
    stale = iter(loader)  # a new pass, begun before the state is loaded
    next(stale)
    loader.load_state_dict(state)
    with pytest.raises(StaleIteratorError, match="call iter"):
        next(stale)
    again = list(loader)
    assert [[s["__key__"] for s in b] for b in again] == [[s["__key__"] for s in b] for b in rest]
    assert len(head) + len(again) == len(loader)


@pytest.mark.parametrize(
    ("field", "change"),
    [("seed", {"seed": 6}), ("shuffle", {"shuffle": False}), ("dataset", {})],
)
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_a_state_from_another_seed_or_dataset_is_refused_naming_the_field(
    fmt, field, change, make_dataset, tmp_path, samples
) -> None:
    from conftest import write_dataset

    path = make_dataset(fmt)
    loader = _loader(path, num_workers=0, transform=None)
    next(iter(loader))
    state = loader.state_dict()
    if field == "dataset":  # same shape, other samples
        path = write_dataset(tmp_path / "other", fmt, {"train": samples[8:40]})
    other = _loader(path, num_workers=0, transform=None, **change)
    with pytest.raises(StateMismatchError, match=f"{field}="):
        other.load_state_dict(state)


def test_a_wds_state_from_another_batch_size_is_refused_naming_the_field(make_dataset) -> None:
    path = make_dataset("wds")
    loader = _loader(path, num_workers=0, transform=None)
    next(iter(loader))
    other = _loader(path, num_workers=0, batch_size=4, transform=None)
    expected = "batch_size=8, this stream order has batch_size=4"
    with pytest.raises(StateMismatchError, match=expected):
        other.load_state_dict(loader.state_dict())


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_each_iter_is_a_pass_whether_or_not_a_batch_was_drawn(fmt, workers, make_dataset) -> None:
    loader = _loader(make_dataset(fmt), num_workers=workers, transform=None)
    iter(loader)
    epochs = []
    for _ in range(2):
        iterator = iter(loader)
        epochs.append(loader.state_dict()["epoch"])
    next(iterator)
    assert epochs == [1, 2] and loader.state_dict()["epoch"] == 2
    loader.close()
