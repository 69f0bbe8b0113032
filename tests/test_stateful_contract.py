"""The `Stateful` contract, one test for every resumable component of loading and training.

Each case builds a component, advances it part-way, saves ``state_dict()``, round-trips the
state through ``torch.save`` / ``torch.load(weights_only=True)`` (what a checkpoint does),
restores it into a fresh component built the same way, and checks that what follows equals
what the original yields as it goes on. A state is untrusted input: a crafted value in any
field (another type, a bool for a count, a sign, a size past the range) is refused with a
`StateMismatchError` naming the field, and the component is left as it was. A last test walks
``dlpipe.loading`` and ``dlpipe.train`` so that a new class with a ``state_dict`` cannot skip
the contract, and another walks ``dlpipe.loading`` for sample orders: each one a loader drives
through the one pass contract (`PassOrder`) is under it through a loader case of its kind.
"""

from __future__ import annotations

import importlib
import inspect
import io
import itertools
import math
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from trainer_models import oom_above_4

import dlpipe
from dlpipe.loading.order import EpochSampler, PassOrder
from dlpipe.loading.state import Stateful, StateMismatchError
from dlpipe.train.counters import EarlyStopping, RunCounters
from dlpipe.train.distributed import Distributed
from dlpipe.train.step import Precision, StepResult, StepRunner

ADVANCE = 3  # outputs taken before the save
FOLLOW = 12  # outputs compared after it


@dataclass(frozen=True)
class Case:
    """A component under contract: `build(data)` makes one (data: a dataset folder or None);
    `outputs(component, start)` is what it yields from here on, one comparable value at a
    time, given the inputs from the `start`-th on (components that read no input ignore it)."""

    name: str
    covers: tuple[str, ...]  # the classes whose state the case saves and restores
    build: Callable[[Any], Any]
    outputs: Callable[[Any, int], Iterator[Any]]
    data: str | None = None  # the format of the dataset `build` gets


def _sampler(_: Any) -> EpochSampler:
    return EpochSampler(23, rank=1, world_size=2, seed=7, block=3, drop_last=False)


def _sampler_outputs(sampler: EpochSampler, start: int) -> Iterator[Any]:
    while True:  # epoch after epoch: the restored one must finish the epoch and go on
        yield from sampler


def _loader(path: str) -> Any:
    return dlpipe.make_loader(
        path, "train", dlpipe.LoaderConfig(batch_size=4, image_size=8, seed=5), workers=0
    )


def _threaded_loader(path: str) -> Any:
    threads = dlpipe.WorkerSettings(num_workers=2, engine="threads")
    return dlpipe.make_loader(
        path, "train", dlpipe.LoaderConfig(batch_size=4, image_size=8, seed=5), workers=threads
    )


def _mixed_loader(path: str) -> Any:
    """A mixture of the dataset with itself (its two sources: the state names both)."""
    config = dlpipe.LoaderConfig(batch_size=4, image_size=8, seed=5, weights=(0.75, 0.25))
    return dlpipe.make_loader([path, path], "train", config, workers=0)


def _mixed_outputs(loader: Any, start: int) -> Iterator[Any]:
    while True:
        for images, labels, sources in loader:
            yield images.sum().item(), labels.tolist(), sources.tolist()


def _mixture_batches(path: str) -> Any:
    """The trainer's view of a mixture's loader: its sources stripped and counted."""
    from dlpipe.train.sources import MixtureBatches

    return MixtureBatches(_mixed_loader(path), rank=0)


def _mixture_batches_outputs(batches: Any, start: int) -> Iterator[Any]:
    while True:
        for images, labels in batches:
            yield images.sum().item(), labels.tolist()
        yield batches.finished  # the epoch's samples per source, those before a resume too


def _loader_outputs(loader: Any, start: int) -> Iterator[Any]:
    while True:
        for images, labels in loader:
            yield images.sum().item(), labels.tolist()


def _runner(_: Any) -> tuple[StepRunner, Any]:
    torch.manual_seed(0)
    model = oom_above_4(4)  # a batch of 8 runs out of memory: the runner backs off to 4
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    dist = Distributed(0, 1, 0, torch.device("cpu"))
    scaled = Precision("fp16", None)  # a GradScaler on fp32 compute: its scale is state
    runner = StepRunner(model, optimizer, scheduler, dist, scaled)
    return runner, (model, optimizer, scheduler)


def _runner_outputs(built: tuple[StepRunner, Any], start: int) -> Iterator[Any]:
    runner, _ = built
    for step in itertools.count(start):
        generator = torch.Generator().manual_seed(step)
        images = torch.randint(0, 256, (8, 3, 8, 8), dtype=torch.uint8, generator=generator)
        labels = torch.randint(0, 4, (8,), generator=generator)
        splits_before = runner.splits  # a runner that forgot its backoff runs out of memory
        result: StepResult = runner.run([(images, labels)])
        yield splits_before, result.loss, runner.splits, runner.scaler.get_scale()


def _early_stop(_: Any) -> EarlyStopping:
    return EarlyStopping(patience=2)


def _early_stop_outputs(stopping: EarlyStopping, start: int) -> Iterator[Any]:
    losses = [1.0, 0.8, 0.9, 0.85, 0.7, 0.75, 0.75, 0.6, 0.65, 0.7, 0.5, 0.55, 0.6, 0.61, 0.4]
    for loss in losses[start:]:
        yield stopping.update(loss), stopping.stale_epochs


def _counters_outputs(counters: RunCounters, start: int) -> Iterator[Any]:
    """The trainer's use of its counters: a step result each step, an epoch every 4."""
    while True:
        counters.step += 1
        result = StepResult(1.0 / counters.step, 16, 0.5, counters.step % 5 == 0, False)
        counters.skipped_steps += result.skipped
        counters.stats.add(result, 0.01, 0.1)
        if counters.step % 4 == 0:
            counters.history.append({"epoch": counters.epoch + 1, "loss": counters.stats.loss_sum})
            counters.epoch += 1
            counters.stats = type(counters.stats)()
        yield counters.state_dict()


CASES = [
    Case("epoch-sampler", ("EpochSampler",), _sampler, _sampler_outputs),
    Case("loader-lmdb", ("PreparedLoader",), _loader, _loader_outputs, data="lmdb"),
    Case("loader-hdf5", ("PreparedLoader",), _loader, _loader_outputs, data="hdf5"),
    # the stream order advances only as the loader yields batches: its state is the loader's
    Case("loader-wds", ("PreparedLoader", "StreamOrder"), _loader, _loader_outputs, data="wds"),
    # the thread engine: the same state, batches resolved from a pool ahead of the caller
    Case("threads-lmdb", ("PreparedLoader",), _threaded_loader, _loader_outputs, data="lmdb"),
    Case("threads-wds", ("PreparedLoader",), _threaded_loader, _loader_outputs, data="wds"),
    # a mixture: the sampler's state plus each source's draws, the weights and the sources
    Case("loader-mixture", ("MixSampler",), _mixed_loader, _mixed_outputs, data="lmdb"),
    # the trainer's mixture loader: the loader's state plus each source's draws at epoch start
    Case(
        "train-mixture",
        ("MixtureBatches",),
        _mixture_batches,
        _mixture_batches_outputs,
        data="lmdb",
    ),
    Case("step-runner", ("StepRunner",), _runner, _runner_outputs),
    Case("early-stopping", ("EarlyStopping",), _early_stop, _early_stop_outputs),
    Case("run-counters", ("RunCounters",), lambda _: RunCounters(), _counters_outputs),
]
# classes with a state_dict whose contract is a whole run, not one object: tested end to end
END_TO_END = {
    "Trainer": "tests/test_train.py::test_resume_replays_the_same_batches_and_reaches_"
    "identical_weights (its state is the sum of the parts above, gathered over ranks)",
}


def _parts(built: Any) -> tuple[Stateful, tuple[Any, ...]]:
    """The component, and the torch objects it works on (saved and restored beside it)."""
    component, companions = built if isinstance(built, tuple) else (built, ())
    assert isinstance(component, Stateful), type(component)
    return component, companions


def _take(outputs: Iterator[Any], count: int) -> list[Any]:
    return [next(outputs) for _ in range(count)]


def _round_trip(state: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _save(built: Any) -> dict[str, Any]:
    component, companions = _parts(built)
    return _round_trip(
        {"component": component.state_dict(), "companions": [c.state_dict() for c in companions]}
    )


def _restore(built: Any, state: dict[str, Any]) -> Any:
    component, companions = _parts(built)
    component.load_state_dict(state["component"])
    for companion, saved in zip(companions, state["companions"], strict=True):
        companion.load_state_dict(saved)
    return built


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_a_restored_component_continues_exactly_like_the_original(case, make_dataset) -> None:
    data = make_dataset(case.data) if case.data else None
    original = case.build(data)
    going_on = case.outputs(original, 0)
    _take(going_on, ADVANCE)
    state = _save(original)
    expected = _take(going_on, FOLLOW)

    restored = _restore(case.build(data), state)
    assert _take(case.outputs(restored, ADVANCE), FOLLOW) == expected
    # the state is what makes the difference: a fresh component does not continue so
    assert _take(case.outputs(case.build(data), ADVANCE), FOLLOW) != expected


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_a_state_of_another_component_is_refused_not_half_loaded(case, make_dataset) -> None:
    component, _ = _parts(case.build(make_dataset(case.data) if case.data else None))
    with pytest.raises(StateMismatchError):
        component.load_state_dict({"something": "else"})


def crafted(value: Any) -> list[Any]:
    """Values of the kinds next to `value`'s that no field saved as `value` takes: other
    types, a bool where a count is, a float where an int is, a sign, a size past any range."""
    if isinstance(value, bool):
        return [int(value), str(value), None]
    if isinstance(value, int):
        return [True, False, -1, value - 2**70, 2**70, float(value), value + 0.5, str(value), None]
    if isinstance(value, float):
        return [str(value), math.nan, math.inf, -1.0, -math.inf, True]
    if value is None:
        return ["x", -1.0, math.nan, True]
    if isinstance(value, str):
        return [1, None, value + "-other", b"x"]
    if isinstance(value, list):
        return ["x", None, 3, {"0": value}, [["a", "b"]], [[True, 2.5]]]
    if isinstance(value, dict):
        return ["x", None, [], {"other": 1}]
    return ["x", None]


def _crafted_states(case: Case, data: str | None) -> Iterator[tuple[Any, str, Any, Any]]:
    """(the component after the save, field, crafted value, its state with it) for every
    field of a state saved part-way."""
    component = case.build(data)
    _take(case.outputs(component, 0), ADVANCE)
    state = _save(component)["component"]
    for name, value in state.items():
        for bad in crafted(value):
            yield component, name, bad, {**state, name: bad}


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_a_crafted_value_in_any_field_is_refused_by_name_and_changes_nothing(
    case, make_dataset
) -> None:
    data = make_dataset(case.data) if case.data else None
    tried = set()
    for built, name, bad, state in _crafted_states(case, data):
        component, _ = _parts(built)
        before = _round_trip(component.state_dict())
        with pytest.raises(StateMismatchError, match=f"{name}") as refused:
            component.load_state_dict(state)
        assert "Error" not in str(refused.value), (name, bad, refused.value)  # no bare one
        assert _round_trip(component.state_dict()) == before, (name, bad)
        tried.add(name)
    # the control: the state as saved loads, and every field of it was tried
    component, _ = _parts(built)
    saved = _round_trip(component.state_dict())
    component.load_state_dict(saved)
    assert tried == set(saved)


def _classes_with_state() -> dict[str, str]:
    """Every class defined in dlpipe.loading or dlpipe.train that has a state_dict or a
    load_state_dict of dlpipe's own (directly or from a dlpipe base): name -> module."""
    found = {}
    for package in ("dlpipe.loading", "dlpipe.train"):
        for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
            module = importlib.import_module(f"{package}.{info.name}")
            for name, cls in inspect.getmembers(module, inspect.isclass):
                if cls.__module__ != module.__name__ or getattr(cls, "_is_protocol", False):
                    continue
                own = [k for k in cls.__mro__ if k.__module__.startswith("dlpipe.")]
                if any({"state_dict", "load_state_dict"} & set(vars(k)) for k in own):
                    found[name] = module.__name__
    return found


def test_every_class_with_a_state_dict_is_under_the_contract() -> None:
    found = _classes_with_state()
    covered = {name for case in CASES for name in case.covers} | set(END_TO_END)
    assert {"EpochSampler", "StepRunner", "RunCounters", "EarlyStopping"} <= set(found)
    missing = {name: module for name, module in found.items() if name not in covered}
    assert not missing, f"add a Case for each of {missing} to CASES"
    stale = covered - set(found)
    assert not stale, f"CASES names classes that no longer have a state_dict: {stale}"


# the sample orders a loader drives (`PassOrder`), each with the loader cases that drive it
PASS_ORDERS = {
    "EpochSampler": ("loader-lmdb", "loader-hdf5"),
    "StreamOrder": ("loader-wds",),
    "MixSampler": ("loader-mixture",),
}
_PASS_METHODS = (
    "dataloader_options",
    "batch_count",
    "start_pass",
    "started",
    "abandon",
    "finish",
    "state_dict",
    "load_pass_state",
)


def _pass_orders() -> set[str]:
    """Every class defined in dlpipe.loading with the methods of the pass contract."""
    found = set()
    for info in pkgutil.iter_modules(importlib.import_module("dlpipe.loading").__path__):
        module = importlib.import_module(f"dlpipe.loading.{info.name}")
        for name, cls in inspect.getmembers(module, inspect.isclass):
            mine = cls.__module__ == module.__name__ and not getattr(cls, "_is_protocol", False)
            if mine and all(callable(getattr(cls, method, None)) for method in _PASS_METHODS):
                found.add(name)
    return found


def test_every_sample_order_is_driven_through_the_pass_contract_by_a_loader_case(
    make_dataset,
) -> None:
    assert _pass_orders() == set(PASS_ORDERS), "add the new order and its loader Case"
    cases = {case.name: case for case in CASES}
    made: dict[str | None, str] = {}  # each format's dataset, made once
    for name, case_names in PASS_ORDERS.items():
        for case_name in case_names:
            case = cases[case_name]
            if case.data not in made:
                made[case.data] = make_dataset(case.data)
            order = case.build(made[case.data]).order
            assert isinstance(order, PassOrder) and type(order).__name__ == name, case_name
            progress = order.start_pass(1)  # nothing given yet: the state between passes
            assert progress.state() == order.state_dict()
