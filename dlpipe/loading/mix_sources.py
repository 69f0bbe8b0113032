"""A mixture's sources, opened and checked: `open_sources` reads `make_loader`'s first
argument (one path: `open_dataset`; a list: a `MixedDataset`) and checks the mixing fields of
`LoaderConfig` against the sources (`dlpipe.loading.mixing` holds the order and its state).

Sources are datasets of any format (a wds one read by index through its shard readers'
`get`: ``open_dataset(..., by_index=True)``), local or at URLs, of one task
(classification and unlabelled ones mix; detection sources all with instance masks or none;
segmentation sources with one ignore value) and one image field; anything else is one
`LoaderConfigError` naming it and the fix. Each source keeps its own recipe (its targets
checked against its own classes), its labels then mapped. URL sources read through their
shard caches, each planned from the mixture's codes that are its samples
(`MixedDataset.follow`), and share one ``cache_limit`` in proportion to their sizes
(`dlpipe.loading.remote.share_limit`).

Class spaces map by name onto the first source's (`dlpipe.loading.class_maps`).
"""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch.utils.data

from dlpipe.loading.class_maps import class_maps
from dlpipe.loading.config import LoaderConfig, LoaderConfigError
from dlpipe.loading.dataset import MapDataset, PreparedDataset, open_dataset
from dlpipe.loading.mixing import (
    MAX_EPOCH_SAMPLES,
    MIX_RULES,
    SOURCE_FIELD,
    Mixture,
    SourceIdentity,
    checked_weights,
)
from dlpipe.loading.order import EpochSampler
from dlpipe.loading.remote import share_limit
from dlpipe.loading.state import is_int
from dlpipe.loading.targets import TARGET_TASKS, TargetSpec
from dlpipe.loading.transforms import image_field
from dlpipe.manifest import Manifest

__all__ = ["MixedDataset", "open_sources", "several_paths"]


class MixedDataset(torch.utils.data.Dataset):
    """The opened sources of a mixture, read by global code (`MixSampler`'s).

    Attributes:
        sources: each source's split, in the order given.
        mixture: the checked weights, rule and epoch length.
        classes: the mixture's class names (the first source's).
        labels: per source, its label index → the mixture's (None: the same indices).
    """

    def __init__(
        self,
        sources: list[MapDataset],
        mixture: Mixture,
        classes: tuple[str, ...],
        labels: list[np.ndarray] | None,
    ) -> None:
        self.sources, self.mixture, self.classes, self.labels = sources, mixture, classes, labels
        self.offsets = list(itertools.accumulate((len(s) for s in sources), initial=0))
        self.split, self.rank, self.world_size = (
            sources[0].split,
            sources[0].rank,
            sources[0].world_size,
        )

    @property
    def path(self) -> str:
        """The first source's path (where a saved loader profile is looked up)."""
        return self.sources[0].path

    @property
    def manifest(self) -> Manifest:
        """The first source's manifest (its fields name the image field)."""
        return self.sources[0].manifest

    def identity(self) -> dict[str, Any]:
        """What a loader state names as its dataset: a mixture (its order checks the
        sources, naming them), and the split."""
        return {"dataset": "mixture", "split": self.split}

    def __len__(self) -> int:
        return self.offsets[-1]

    def locate(self, code: int) -> tuple[int, int]:
        """(source, index in it) of a `MixSampler` code."""
        at = code % len(self)
        source = bisect.bisect_right(self.offsets, at) - 1
        return source, at - self.offsets[source]

    def __getitem__(self, code: int) -> Any:
        return self.read(code)

    def read(self, code: int, epoch: int | None = None) -> Any:
        """The sample of `code`, its source's index added; with the loader's `epoch`, its
        source's cache (a URL's) is told the read first, and plans from it."""
        source, index = self.locate(code)
        if epoch is not None:
            self.sources[source].readers.reading(epoch, code)
        return {**self.sources[source][index], SOURCE_FIELD: source}

    def follow(self, sampler: EpochSampler) -> None:
        """The loader draws its codes from `sampler` (a `MixSampler`): each remote source's
        cache plans its reads from the codes that are its samples."""
        for source, offset in zip(self.sources, self.offsets, strict=False):
            source.readers.follow(sampler, (offset, len(self)))

    def close(self) -> None:
        for source in self.sources:
            source.close()


def several_paths(path: Any) -> bool:
    """Whether `path` (make_loader's first argument) names several datasets."""
    return isinstance(path, Sequence) and not isinstance(path, str | bytes)


def open_sources(
    path: Any,
    split: str,
    config: LoaderConfig,
    *,
    rank: int | None,
    world_size: int | None,
    **reading: Any,
) -> PreparedDataset | MixedDataset:
    """`path`'s split opened (`open_dataset`, with `reading`: its cache and version), or a
    list of paths as one `MixedDataset`, with `config`'s mixing fields checked against the
    sources.

    Raises:
        LoaderConfigError: a mixing field given for one dataset,
            bad weights, an epoch length or rule, or class spaces that do not map (named).
    """
    if not several_paths(path):
        _refuse_mixing_fields(config)
        return open_dataset(path, split, rank=rank, world_size=world_size, **reading)
    if not path:
        raise LoaderConfigError("path=[] names no dataset; pass one path, or a list of several")
    if reading.get("version") is not None:
        raise LoaderConfigError(
            f"dataset_version={reading['version']!r} names a version of one dataset, and a "
            "mixture reads several: leave it out (each source is read at its latest version)"
        )
    names = [os.fspath(p) for p in path]
    sources = [_by_index(name, split, rank, world_size, reading) for name in names]
    share_limit([s.readers.remote for s in sources if s.readers.remote], reading.get("cache_limit"))
    identities = tuple(
        SourceIdentity(name, source.stamp.sha256, len(source))
        for name, source in zip(names, sources, strict=True)
    )
    rule = _rule(config.on_source_end)
    weights = checked_weights(config.weights, len(sources), rule, [len(s) for s in sources])
    samples = _epoch_samples(config.epoch_samples, sum(len(s) for s in sources), rule)
    _check_fields(sources, names, config)
    classes, labels = class_maps([s.manifest for s in sources], names, config.class_map)
    mixture = Mixture(identities, weights, rule, samples)
    return MixedDataset(sources, mixture, classes, labels)


def _refuse_mixing_fields(config: LoaderConfig) -> None:
    for name, unset in (
        ("weights", None),
        ("epoch_samples", None),
        ("class_map", None),
        ("on_source_end", "cycle"),
    ):
        value = getattr(config, name)
        if value != unset:
            raise LoaderConfigError(
                f"{name}={value!r} mixes several datasets, but one path was given; pass a list "
                f"of dataset paths, or leave {name} out"
            )


def _by_index(
    name: str, split: str, rank: int | None, world_size: int | None, reading: dict[str, Any]
) -> MapDataset:
    dataset = open_dataset(name, split, rank=rank, world_size=world_size, by_index=True, **reading)
    assert isinstance(dataset, MapDataset)  # every format's shard reader answers `get`
    return dataset


def _rule(value: Any) -> str:
    if not isinstance(value, str) or value not in MIX_RULES:
        raise LoaderConfigError(
            f"on_source_end={value!r} is not 'cycle' or 'stop'; pass 'cycle' (a source that "
            "runs out starts its next permutation) or 'stop' (each sample once an epoch)"
        )
    return value


def _epoch_samples(value: Any, total: int, rule: str) -> int:
    if value is None:
        return total
    most = total if rule == "stop" else MAX_EPOCH_SAMPLES
    if not is_int(value) or not 1 <= value <= most:
        why = " (on_source_end='stop' reads each sample at most once)" if rule == "stop" else ""
        raise LoaderConfigError(
            f"epoch_samples={value!r} is not an integer in 1..{most}{why}; pass a sample "
            "count, or None for the sources' total"
        )
    return int(value)


def _check_fields(sources: list[MapDataset], names: list[str], config: LoaderConfig) -> None:
    """The sources share a task and, for the image transforms, an image field."""
    tasks = {name: source.manifest.task for name, source in zip(names, sources, strict=True)}
    if set(tasks.values()) - {None, "classification"} and len(set(tasks.values())) > 1:
        raise LoaderConfigError(
            f"the mixture's sources are of the tasks {tasks}: a mixture reads datasets of one "
            "task (classification and unlabelled ones mix); mix datasets of the same task"
        )
    _check_targets(sources, names)
    if config.transform in ("train", "eval", "auto"):
        fields = {name: _image_field(source) for name, source in zip(names, sources, strict=True)}
        if len(set(fields.values())) > 1:
            raise LoaderConfigError(
                f"the mixture's sources keep their images in different fields ({fields}); "
                "the image transforms read one field: convert them alike"
            )


def _check_targets(sources: list[MapDataset], names: list[str]) -> None:
    """Detection sources all carry instance masks or none; segmentation sources share an
    ignore value (one batch, one loss)."""
    task = sources[0].manifest.task
    if task not in TARGET_TASKS:
        return
    specs = {}
    for name, source in zip(names, sources, strict=True):
        try:
            specs[name] = TargetSpec.from_manifest(source.manifest)
        except ValueError as exc:
            raise LoaderConfigError(f"mixture source {name}: {exc}") from None
    for what, attr in (("instance masks", "instance_masks"), ("ignore value", "ignore")):
        values = {name: getattr(spec, attr) for name, spec in specs.items()}
        if len(set(values.values())) > 1:
            raise LoaderConfigError(
                f"the mixture's {task} sources differ in their {what} ({values}); one batch "
                f"needs one: convert them alike, or mix only sources that agree"
            )


def _image_field(source: MapDataset) -> str | None:
    try:
        return image_field(list(source.manifest.fields))
    except ValueError:
        return None
