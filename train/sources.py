"""Several datasets in one run: ``dlpipe train A B --weights 0.7,0.3`` (or ``[data] path =
["A", "B"]``, or ``[[data.sources]]`` tables in ``--config``).

A run's ``[data] path`` is one dataset or several; several are one seeded, weighted mixture
(`dlpipe.loading.mixing`), read through `make_loader` given the list and the ``[data.loader]``
mixing options (``weights``, ``on_source_end``, ``epoch_samples``, ``class_map``). Here is
what the trainer needs of that, in one place:

    path = loader_path(config.data.path)      # "A", or ["A", "B"]: a mixture
    loader = MixtureBatches(make_loader(path, "train", loader_config), rank=rank)
    for images, labels in loader: ...          # the batches' sources stripped and counted
    counts = epoch_source_samples(loader, dist)  # [n_A, n_B] over all ranks, or None

Validation reads every dataset's val split as one mixture by size (each val sample once an
epoch, `split_config`). A mixture's loader profile is its first dataset's: `make_loader` looks
it up there, so the trainer tunes and saves it there too (`profile_target`). The samples each
dataset gave an epoch are exact across a resume: a loader state carries each dataset's draws
when its epoch began (`SOURCE_START`), and the draws in it are global positions, so a state
taken on N ranks resumes on M with the same counts.

The run's classes are the first dataset's (its manifest's: the model's outputs, the checkpoint's
``classes``). Another dataset's class names map onto them by name; one the first lacks needs a
class map (``classes = { kitty = "cat" }`` in its ``[[data.sources]]`` table, ``--class-map
1:kitty=cat``, written as ``[data.loader] class_map``), checked before torchrun in the user's
words (`check_sources`). A checkpoint resumes only with the class map it was trained with
(`check_same_class_map`): another map changes the labels the model learned from.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import tomli_w
import torch

from dlpipe.loading.class_maps import ClassMapError, class_map_by_source
from dlpipe.loading.config import LoaderConfig
from dlpipe.loading.state import SAVED_BY_DLPIPE, is_int, mismatch, shown
from dlpipe.options import table_text
from dlpipe.train.checkpoint import CheckpointError
from dlpipe.train.config import ConfigError, TrainConfig

__all__ = [
    "SOURCE_START",
    "MixtureBatches",
    "check_same_class_map",
    "check_sources",
    "described",
    "epoch_source_samples",
    "loader_path",
    "profile_target",
    "single",
    "source_samples_text",
    "split_config",
]

SOURCE_START = "source_epoch_start"  # in a mixture's state: the draws as its epoch began
_MIXING = {"weights": None, "on_source_end": "cycle", "epoch_samples": None, "class_map": None}
_MAX_SHOWN = 300  # characters of a class map in a message


def loader_path(paths: Sequence[str]) -> str | list[str]:
    """What `make_loader` takes for a run's ``[data] path``: the one dataset, or the list."""
    return paths[0] if len(paths) == 1 else list(paths)


def single(config: TrainConfig, path: str) -> TrainConfig:
    """`config` with `path` as its only dataset (each dataset of a mixture is checked so)."""
    return dataclasses.replace(config, data=dataclasses.replace(config.data, path=(path,)))


def split_config(config: LoaderConfig, transform: str) -> LoaderConfig:
    """A run's loader config for its train (``"train"``) or val (``"eval"``) loader: the val
    loader of a mixture reads every val sample once (each dataset's share its size)."""
    if transform == "train":
        return config
    return config.replace(weights=None, epoch_samples=None)


def profile_target(paths: Sequence[str], config: LoaderConfig) -> tuple[str, LoaderConfig]:
    """Where the run's loader profile is looked up, tuned and saved: the first dataset, and
    `config` without the mixing options (they do not change the work per sample)."""
    return paths[0], config.replace(**_MIXING)


def check_sources(config: TrainConfig) -> None:
    """The mixing options fit the datasets given: with one dataset, none is set; with several,
    the mixture opens as `make_loader` opens it (datasets of one task and image
    field, one weight each, every class mapping onto the first dataset's: a class map's
    error names its fix in a run's words), so a launcher refuses it before torchrun.

    Raises:
        ConfigError: a mixing option with one dataset, a class that does not map, or a
            mixture `make_loader` refuses.
    """
    from dlpipe.loading.config import LoaderConfigError
    from dlpipe.loading.mix_sources import open_sources

    d = config.data
    if len(d.path) == 1:
        for name, unset in _MIXING.items():
            value = getattr(d.loader, name)
            if value != unset:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(
                    f"{flag} {_shown(value)} mixes several datasets, but one was given "
                    f"({d.path[0]}): give several DATA paths, or leave {flag} out"
                )
        return
    try:
        open_sources(list(d.path), d.train_split, d.loader, rank=0, world_size=1).close()
    except ClassMapError as exc:
        raise ConfigError(_in_train_words(exc)) from None
    except LoaderConfigError as exc:
        raise ConfigError(f"dlpipe train {' '.join(d.path)}: {exc}") from None


def _in_train_words(exc: ClassMapError) -> str:
    """A class map's error with its fix as a run gives a map: the dataset's ``classes``
    table or ``--class-map``."""
    if exc.source is None:
        return exc.problem
    n = exc.source
    if exc.unmapped is None:
        return f"{exc.problem} (classes in [[data.sources]] table {n + 1}, or --class-map {n}:...)"
    pair = tomli_w.dumps({exc.unmapped: "CLASS"}).strip()
    return (
        f"{exc.problem}: classes = {{ {pair} }} in its [[data.sources]] table, or "
        f"--class-map {n}:{exc.unmapped}=CLASS"
    )


def check_same_class_map(state: Mapping[str, Any], path: str, config: TrainConfig) -> None:
    """Refuse a checkpoint trained with another class map than this run's (the same map with
    datasets named by path or number, or with a class mapped onto itself, is the same).

    Raises:
        CheckpointError: naming both maps and the fix.
    """
    paths, saved, now = config.data.path, _saved_class_map(state), config.data.loader.class_map
    if _effect(paths, saved) == _effect(paths, now):
        return
    was, given = (_map_text(m) for m in (saved, now))
    fix = f"resume with {was}" if saved else "resume without one"
    raise CheckpointError(
        f"checkpoint {path} was trained with {was}, and this run gives {given}: another class "
        f"map changes the labels the model learned; {fix}, or start afresh in another --out"
    )


def _map_text(class_map: Any) -> str:
    """``--class-map 1:kitty=cat``, or ``no class map``."""
    if not class_map:
        return "no class map"
    if not isinstance(class_map, Mapping) or not all(
        isinstance(m, Mapping) for m in class_map.values()
    ):
        return f"the class map {shown(class_map)}"  # (an untrusted checkpoint's)
    text = table_text(class_map)
    return f"--class-map {text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 3] + '...'}"


def _saved_class_map(state: Mapping[str, Any]) -> Any:
    """The class map a checkpoint's config records (None: none, or a checkpoint before it)."""
    config = state.get("config")
    data = config.get("data") if isinstance(config, Mapping) else None
    loader = data.get("loader") if isinstance(data, Mapping) else None
    return loader.get("class_map") if isinstance(loader, Mapping) else None


def _effect(paths: Sequence[str], class_map: Any) -> Any:
    """What a class map does: per dataset number, the classes it renames (a map that is no
    table of tables of names is itself, and so differs from every other)."""
    try:
        maps = class_map_by_source(class_map, paths)
    except ClassMapError:
        return class_map
    renamed = {n: {a: b for a, b in m.items() if a != b} for n, m in maps.items()}
    return {n: m for n, m in renamed.items() if m}


def described(paths: Sequence[str], config: LoaderConfig) -> str:
    """``A`` or ``A, B (weights 0.7, 0.3; on_source_end cycle)`` (and ``; class map
    1:kitty=cat``): the run's data for its start line."""
    if len(paths) == 1:
        return paths[0]
    weights = "by size" if config.weights is None else ", ".join(f"{w:g}" for w in config.weights)
    mapped = f"; class map {table_text(config.class_map)}" if config.class_map else ""
    return f"{', '.join(paths)} (weights {weights}; on_source_end {config.on_source_end}{mapped})"


def _shown(value: Any) -> str:
    if isinstance(value, Mapping):
        return table_text(value) or "{}"
    if isinstance(value, tuple | list):
        return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
    return str(value)


class MixtureBatches:
    """A mixture's loader as the trainer reads it: ``(images, labels)`` batches, each sample's
    dataset counted (`finished`: this rank's counts of the last pass that ran to its end,
    rank 0's with the draws of its epoch before a resumed position). Everything else is the
    loader's: ``len``, ``settings``, ``order``, ``close``; its state adds `SOURCE_START`.

    Args:
        loader: a `make_loader` of several datasets (its batches ``(images, labels,
            sources)``).
        rank: this process's rank (rank 0 carries the counts from before a resume).
    """

    def __init__(self, loader: Any, *, rank: int) -> None:
        self.loader, self.rank = loader, rank
        self.finished: list[int] | None = None
        self._start: list[int] | None = None  # each dataset's draws (global) as the epoch began
        self._carried: list[int] | None = None  # the epoch's draws before a loaded position

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["loader"], name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        batches = iter(self.loader)
        cursors = _cursors(self.loader.state_dict())
        if self._carried is None:  # a pass from its epoch's start
            self._start, self._carried = cursors, [0] * len(cursors)
        carried, self._carried = self._carried, None
        return self._counted(batches, carried if self.rank == 0 else [0] * len(carried))

    def _counted(self, batches: Iterator[Any], carried: list[int]) -> Iterator[tuple[Any, Any]]:
        counts = torch.tensor(carried, dtype=torch.int64)
        for images, labels, sources in batches:
            counts += torch.bincount(sources.cpu(), minlength=len(carried))
            yield images, labels
        self.finished = counts.tolist()

    def state_dict(self) -> dict[str, Any]:
        """The loader's state, plus each dataset's draws when its epoch began."""
        state = self.loader.state_dict()
        start = self._start if self._start is not None else _cursors(state)
        return {**state, SOURCE_START: list(start)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The loader's `load_state_dict`, with `SOURCE_START` checked first (a state without
        it counts the epoch from the loaded position); nothing changes when either refuses.

        Raises:
            StateMismatchError: `SOURCE_START` is not one draw count per dataset, each at
                most the state's ``cursors``; or the loader refuses the rest (named).
        """
        if not isinstance(state, Mapping) or SOURCE_START not in state:
            self.loader.load_state_dict(state)  # (refuses one that is not a mixture's)
            self._start = _cursors(self.loader.state_dict())
            self._carried = [0] * len(self._start)
            return
        rest = {key: value for key, value in state.items() if key != SOURCE_START}
        if not _counts(rest.get("cursors")):
            self.loader.load_state_dict(rest)  # refuses them, naming the field
        start = _checked_start(state[SOURCE_START], rest["cursors"])
        self.loader.load_state_dict(rest)
        cursors = _cursors(rest)
        self._start = start
        self._carried = [now - then for now, then in zip(cursors, start, strict=True)]


def _cursors(state: Mapping[str, Any]) -> list[int]:
    """Each dataset's draws at a mixture loader state's position (global, all ranks)."""
    return [int(c) for c in state["cursors"]]


def _counts(value: Any) -> bool:
    return isinstance(value, list) and all(is_int(c) and c >= 0 for c in value)


def _checked_start(value: Any, cursors: list[int]) -> list[int]:
    if not (
        _counts(value)
        and len(value) == len(cursors)
        and all(s <= c for s, c in zip(value, cursors, strict=True))
    ):
        rule = "it must be one draw count per dataset, each at most the state's cursors"
        raise mismatch("mixture", SOURCE_START, value, rule, SAVED_BY_DLPIPE)
    return [int(s) for s in value]


def epoch_source_samples(loader: Any, dist: Any) -> list[int] | None:
    """The samples each dataset gave the epoch that just ended, over all ranks (collective:
    every rank calls it); None for one dataset."""
    if not isinstance(loader, MixtureBatches) or loader.finished is None:
        return None
    counts = torch.tensor(loader.finished, dtype=torch.int64, device=dist.device)
    dist.all_reduce_(counts, what="summing the epoch's samples per dataset")
    return [int(c) for c in counts.tolist()]


def source_samples_text(paths: Sequence[str], counts: Sequence[int] | None) -> str:
    """`` | samples A 700, B 300`` for the epoch line ("" for one dataset)."""
    if counts is None:
        return ""
    names = [os.path.basename(os.path.normpath(p)) or p for p in paths]
    return " | samples " + ", ".join(f"{n} {c}" for n, c in zip(names, counts, strict=True))
